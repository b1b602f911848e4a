package org.pagedkv.demo.core

/**
 * How big the KV pool may be, and how it reacts to memory pressure. Plain Kotlin (no Android
 * imports): the Android layer fills [MemorySnapshot] from ActivityManager and passes trim levels
 * from ComponentCallbacks2; the numbers are the platform's documented constants.
 */
data class MemorySnapshot(
    val availMem: Long,      // ActivityManager.MemoryInfo.availMem
    val threshold: Long,     // MemoryInfo.threshold: below this the system starts killing
    val lowMemory: Boolean,  // MemoryInfo.lowMemory
    val lastTrimLevel: Int,  // ActivityManager.getMyMemoryState(): RunningAppProcessInfo.lastTrimLevel
)

object PoolPolicy {
    // ComponentCallbacks2 levels (API constants). Android 14+ delivers only UI_HIDDEN and BACKGROUND to apps;
    // the RUNNING_* levels are deprecated and no longer sent, so the policy cannot wait for them.
    const val TRIM_MEMORY_RUNNING_MODERATE = 5
    const val TRIM_MEMORY_RUNNING_LOW = 10
    const val TRIM_MEMORY_RUNNING_CRITICAL = 15
    const val TRIM_MEMORY_UI_HIDDEN = 20
    const val TRIM_MEMORY_BACKGROUND = 40

    const val MIN_BUDGET_BYTES = 4L shl 20
    const val DEFAULT_SETTING_MIB = 64L

    /** The pool budget: the setting, but at most a quarter of what is available above the kill threshold. */
    fun budgetBytes(settingMiB: Long, mem: MemorySnapshot): Long {
        val headroom = ((mem.availMem - mem.threshold) / 4).coerceAtLeast(MIN_BUDGET_BYTES)
        return minOf(settingMiB.coerceAtLeast(1L) shl 20, headroom)
    }

    /**
     * Free blocks to keep when the app is told to trim at [level]; null = do nothing.
     * UI hidden (the user left the app): keep a few so a quick return can answer at once.
     * Background (the app is on the LRU list, next to be killed): give back every free block.
     */
    fun keepFreeOnTrim(level: Int): Int? = when {
        level >= TRIM_MEMORY_BACKGROUND -> 0
        level >= TRIM_MEMORY_UI_HIDDEN -> 4
        else -> null  // RUNNING_* (pre-Android 14 only): handled before each turn instead
    }

    /**
     * Usable blocks to have before a turn (the pool grows back to it after a trim). Checked before every
     * turn with getMyMemoryState, because Android 14+ no longer reports pressure while the app is in front:
     * under pressure the pool only grows to what the turn needs plus a little, not back to the budget.
     */
    fun usableBeforeTurn(mem: MemorySnapshot, budgetBlocks: Int, usedBlocks: Int, turnBlocks: Int): Int {
        val need = (usedBlocks + turnBlocks).coerceAtMost(budgetBlocks)
        val pressed = mem.lowMemory || mem.lastTrimLevel >= TRIM_MEMORY_RUNNING_LOW || mem.availMem <= mem.threshold
        return if (pressed) need else budgetBlocks
    }

    /** Blocks a turn of [promptTokens] + [maxNewTokens] may need, given [blockSize]. */
    fun blocksForTurn(promptTokens: Int, maxNewTokens: Int, blockSize: Int): Int =
        (promptTokens + maxNewTokens + blockSize - 1) / blockSize + 1
}

/**
 * Threads for the runner: the performance cores, as ExecuTorch's LLM runner picks them (cpuinfo:
 * every core but those of the slowest cluster when the cores differ; all of them when they do not).
 */
object CoreCount {
    /** [maxFreqKHz]: cpuinfo_max_freq of each core (0 = unknown). */
    fun performanceCores(maxFreqKHz: List<Long>): Int {
        val known = maxFreqKHz.filter { it > 0 }
        if (known.isEmpty()) return maxOf(1, maxFreqKHz.size / 2).coerceAtMost(4)
        val slowest = known.minOrNull()!!
        val fast = known.count { it > slowest }
        return if (fast == 0) known.size else fast
    }

    /** Reads /sys/devices/system/cpu/cpu<N>/cpufreq/cpuinfo_max_freq for cores 0..n-1 (0 where unreadable). */
    fun readMaxFreqs(cpuDir: java.io.File, n: Int): List<Long> = (0 until n).map { i ->
        try {
            java.io.File(cpuDir, "cpu$i/cpufreq/cpuinfo_max_freq").readText().trim().toLong()
        } catch (e: Exception) {
            0L
        }
    }
}
