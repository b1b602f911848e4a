package org.pagedkv.demo.core

import org.pagedkv.demo.NativeRunner
import org.pagedkv.demo.PoolExhaustedException
import java.io.File
import java.util.concurrent.ExecutorService
import java.util.concurrent.Executors
import java.util.concurrent.TimeUnit

/**
 * The app's chat over the native runner, owned by the Application (it outlives Activities: rotation
 * keeps the chat and the pool). Plain Kotlin over [NativeRunner] (no Android imports), so the host
 * JVM tests run it against the real runner.
 *
 * One serial executor owns the runner: every native call, creation and close() included, runs on it,
 * so no call can race with close (use after free). Every task catches Throwable and shows it.
 * [onChange] is called (on the runner's thread) after anything visible changed; the Android layer posts
 * a redraw to the main thread.
 */
class ChatEngine(private val onChange: () -> Unit) {
    private val exec: ExecutorService = Executors.newSingleThreadExecutor { r -> Thread(r, "pagedkv-runner") }
    private var runner: NativeRunner? = null  // touched only on exec
    private var conversation = -1
    private var budgetBlocks = 0

    val transcript = Transcript()
    @Volatile var status: String = "Not loaded."
        private set
    @Volatile var stats: NativeRunner.Stats? = null
        private set
    @Volatile var ready = false
        private set
    @Volatile var closed = false
        private set
    var maxNewTokens = 256
    var temperature = 0.7f
    /**
     * Where the chat is saved (a conversation file, toolkit/CONVERSATION_FORMAT.md: its KV blocks,
     * tokens and messages): written on [save] (onStop) and [trim] (onTrimMemory), read back by [start],
     * so a process Android killed comes back with its chat and no prefill. null: never saved.
     */
    @Volatile var saveFile: File? = null
    /**
     * The runner's pressure policy (RunnerConfig::policy), read by [start]: "adaptive" is issue 25's ladder. A
     * turn that needs blocks that are not free first re-quantizes aged blocks into the .pte's compact region,
     * then spills idle conversations to [spillDir], then slides; the check before each turn only sets the
     * pool's limit, the runner climbs the ladder inside the turn.
     */
    var policy = "adaptive"
    /** Recent tokens a conversation keeps in the default region (older blocks may go to the compact tier). */
    var compactHorizon = 1024
    /** Where idle conversations are spilled (the app's cache dir); null = no spill rung. */
    var spillDir: File? = null

    /** Runs [body] on the runner's thread; any Throwable becomes a visible note, never a crash. */
    private fun task(what: String, body: () -> Unit) {
        if (closed) return
        exec.execute {
            try {
                body()
            } catch (t: Throwable) {
                status = "$what failed: ${describe(t)}"
                transcript.note("[$status]")
            } finally {
                onChange()
            }
        }
    }

    /** (Re)creates the runner: the old one is closed first (on this thread), then the pool is preallocated. */
    fun start(modelDir: File, budgetBytes: Long, threads: Int) = task("loading the model") {
        ready = false
        runner?.close()
        runner = null
        stats = null
        status = "Preallocating a ${budgetBytes shr 20} MiB KV pool, loading the model with $threads threads..."
        onChange()
        val r = NativeRunner(modelDir.absolutePath, budgetBytes, threads, "", policy, compactHorizon,
            spillDir?.absolutePath ?: "")
        runner = r
        conversation = restoreOrNew(r)
        budgetBlocks = r.stats().usableBlocks
        stats = r.stats()
        ready = true
        status = "Ready."
    }

    /** Queues a turn; [memory] is read on the runner's thread just before the turn starts. */
    fun send(text: String, memory: () -> MemorySnapshot): Transcript.Turn? {
        if (closed || !ready || transcript.active() != null) return null
        val turn = transcript.add(text)
        onChange()
        task("the turn") {
            val r = runner ?: throw IllegalStateException("the runner is not loaded")
            if (turn.stopRequested) {  // Stop came before the turn started: it never runs
                transcript.finish(turn, Transcript.State.STOPPED)
                return@task
            }
            transcript.started(turn)
            onChange()
            val st = r.stats()
            val want = PoolPolicy.usableBeforeTurn(memory(), budgetBlocks, st.usedBlocks,
                PoolPolicy.blocksForTurn(text.length, maxNewTokens, st.blockSize))
            if (want > st.usableBlocks) r.grow(want)  // trimmed earlier: take back what this turn may use
            var lastStats = 0L
            try {
                r.chat(conversation, text, maxNewTokens, temperature) { _, piece ->
                    transcript.append(turn, piece)
                    val now = System.nanoTime()
                    if (now - lastStats > 250_000_000L) {  // live speed while streaming, on this thread
                        stats = r.stats()
                        lastStats = now
                    }
                    onChange()
                    !turn.stopRequested  // false ends the turn after this token
                }
                transcript.finish(turn, if (turn.stopRequested) Transcript.State.STOPPED else Transcript.State.DONE)
            } catch (e: PoolExhaustedException) {
                transcript.finish(turn, Transcript.State.FAILED, "KV pool full: ${e.message} Press Clear to start over.")
            } catch (t: Throwable) {
                transcript.finish(turn, Transcript.State.FAILED, describe(t))
            }
            stats = r.stats()
        }
        return turn
    }

    /** Stop: works at any time (a queued turn never starts; a running one ends after its current token). */
    fun stop(): Boolean = transcript.stop() != null

    /** Releases the conversation's blocks at once (after the running turn, which Stop ends first). */
    fun clear() {
        transcript.stop()
        task("clearing") {
            val r = runner ?: return@task
            r.clear(conversation)
            saveFile?.delete()  // a cleared chat does not come back on the next start
            transcript.clear()
            stats = r.stats()
            transcript.note("Cleared: ${stats?.usedBlocks} blocks in use.")
        }
    }

    /** The saved chat when [saveFile] holds one this runner can read; otherwise (none, another model, a
     *  damaged file: the runner checks it and changes nothing) a new conversation, the reason noted. */
    private fun restoreOrNew(r: NativeRunner): Int {
        val f = saveFile
        if (f == null || !f.isFile) return r.newConversation()
        return try {
            val c = r.restore(f.absolutePath)
            transcript.note("[Restored the saved chat: ${r.stats().usedBlocks} blocks, no prefill.]")
            c
        } catch (e: Exception) {
            transcript.note("[The saved chat was not restored: ${e.message}]")
            r.newConversation()
        }
    }

    /** Writes the chat to [saveFile] (atomically, in the native runner); onStop. Queued behind a running turn. */
    fun save() = task("saving the chat") { saveNow() }

    private fun saveNow() {  // on the runner's thread
        val r = runner ?: return
        val f = saveFile ?: return
        if (!ready) return
        r.save(conversation, f.absolutePath)
    }

    /** Memory pressure (ComponentCallbacks2 level). At the levels that shrink the pool ([PoolPolicy]) the
     *  conversation's aged blocks first go to the compact tier (a .pte with a compact region, policy
     *  "adaptive"; each frees a default block), then the chat is saved (the process may be killed next),
     *  then free blocks' pages are given back. Other levels only save. */
    fun trim(level: Int) {
        val keep = PoolPolicy.keepFreeOnTrim(level)
        task("trimming the pool") {
            val r = runner ?: return@task
            val moved = if (keep != null && policy == "adaptive" && ready && r.stats().compactBlocks > 0)
                r.compact(conversation, compactHorizon) else 0
            saveNow()
            if (keep == null) return@task
            val res = r.shrink(r.stats().usedBlocks + keep)
            stats = r.stats()
            status = "trim level $level: " + (if (moved > 0) "$moved aged block(s) compacted, " else "") +
                "usable ${res.usableBefore} -> ${res.usableAfter} blocks, released ${res.releasedBytes shr 10} KiB" +
                (if (res.blockedByUsed > 0) ", ${res.blockedByUsed} used block(s) above the target" else "")
        }
    }

    /** A fresh stats snapshot (the screen's 0.5 s loop; queued behind a running turn, which updates them itself). */
    fun refreshStats() = task("reading stats") {
        stats = runner?.stats()
    }

    /** Waits until every task queued so far has run (tests, shutdown); false on timeout or when closed. */
    fun awaitIdle(timeoutMs: Long): Boolean {
        if (closed) return false
        val done = java.util.concurrent.CountDownLatch(1)
        exec.execute { done.countDown() }
        return done.await(timeoutMs, TimeUnit.MILLISECONDS)
    }

    /** Closes the runner on its own thread and stops the executor; [awaitMs] > 0 waits for it. */
    fun close(awaitMs: Long = 0) {
        if (closed) return
        transcript.stop()
        task("closing") {
            ready = false
            runner?.close()
            runner = null
        }
        closed = true
        exec.shutdown()
        if (awaitMs > 0) exec.awaitTermination(awaitMs, TimeUnit.MILLISECONDS)
    }

    companion object {
        fun describe(t: Throwable): String = when (t) {
            is UnsatisfiedLinkError -> "the native library did not load (${t.message}); this build supports arm64-v8a only"
            else -> "${t.javaClass.simpleName}: ${t.message}"
        }
    }
}
