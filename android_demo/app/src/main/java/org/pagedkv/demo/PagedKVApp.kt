package org.pagedkv.demo

import android.app.ActivityManager
import android.app.Application
import android.content.Context
import android.os.Handler
import android.os.Looper
import org.pagedkv.demo.core.ChatEngine
import org.pagedkv.demo.core.CoreCount
import org.pagedkv.demo.core.MemorySnapshot
import org.pagedkv.demo.core.ModelFiles
import org.pagedkv.demo.core.PoolPolicy
import java.io.File

/**
 * The app-scoped holder: owns the [ChatEngine] (and through it the native runner, its KV pool and the
 * chat), so rotating the phone or re-creating the Activity keeps both. Memory pressure reaches it here
 * (Application is a ComponentCallbacks2), whether or not an Activity exists.
 */
class PagedKVApp : Application() {
    private val main = Handler(Looper.getMainLooper())
    private val listeners = LinkedHashSet<() -> Unit>()

    /** The one engine of the process; its callbacks are re-posted to the main thread for the screen. */
    val engine: ChatEngine by lazy {
        ChatEngine { main.post { listeners.toList().forEach { it() } } }.also {
            it.saveFile = File(filesDir, "chat.pkvc")
            it.spillDir = cacheDir  // the adaptive ladder's spill rung (idle conversations)
        }
    }

    fun addListener(l: () -> Unit) = listeners.add(l)
    fun removeListener(l: () -> Unit) = listeners.remove(l)

    private val activityManager get() = getSystemService(Context.ACTIVITY_SERVICE) as ActivityManager

    /** Memory now: MemoryInfo + this process's last trim level (checked before each turn). */
    fun memory(): MemorySnapshot {
        val info = ActivityManager.MemoryInfo()
        activityManager.getMemoryInfo(info)
        val me = ActivityManager.RunningAppProcessInfo()
        ActivityManager.getMyMemoryState(me)
        return MemorySnapshot(info.availMem, info.threshold, info.lowMemory, me.lastTrimLevel)
    }

    fun settingMiB(): Long = getSharedPreferences("pagedkv", Context.MODE_PRIVATE)
        .getLong("budget_mib", PoolPolicy.DEFAULT_SETTING_MIB)

    fun setSettingMiB(mib: Long) = getSharedPreferences("pagedkv", Context.MODE_PRIVATE).edit()
        .putLong("budget_mib", mib).apply()

    /** The model dir: imported/deployed into files/model, or deployed to a release build's external files dir. */
    fun modelDir(): File? = ModelFiles.choose(File(filesDir, "model"), getExternalFilesDir(null)?.let { File(it, "model") })

    fun threads(): Int {
        val n = Runtime.getRuntime().availableProcessors()
        return CoreCount.performanceCores(CoreCount.readMaxFreqs(File("/sys/devices/system/cpu"), n))
    }

    /** (Re)starts the runner with the current budget; false when there is no model yet. */
    fun startRunner(): Boolean {
        val dir = modelDir() ?: return false
        engine.start(dir, PoolPolicy.budgetBytes(settingMiB(), memory()), threads())
        return true
    }

    override fun onTrimMemory(level: Int) {
        super.onTrimMemory(level)
        engine.trim(level)  // UI_HIDDEN / BACKGROUND (what Android 14+ delivers): compact aged blocks, save, shrink
    }
}
