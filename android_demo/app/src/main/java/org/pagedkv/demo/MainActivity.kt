package org.pagedkv.demo

import android.app.ActivityManager
import android.content.ComponentCallbacks2
import android.content.Context
import android.os.Bundle
import android.os.Handler
import android.os.Looper
import android.text.InputType
import android.view.ViewGroup.LayoutParams.MATCH_PARENT
import android.view.ViewGroup.LayoutParams.WRAP_CONTENT
import android.widget.Button
import android.widget.EditText
import android.widget.LinearLayout
import android.widget.ScrollView
import android.widget.TextView
import androidx.appcompat.app.AppCompatActivity
import java.io.File
import java.util.concurrent.Executors

/**
 * Chat screen over the pagedkv native runner. The runner (and its KV block pool) is created on a
 * background thread at start; every runner call that can take time runs on [worker], one at a time.
 */
class MainActivity : AppCompatActivity() {
    private val worker = Executors.newSingleThreadExecutor()
    private val ui = Handler(Looper.getMainLooper())
    private var runner: NativeRunner? = null
    private var conversation = -1
    private var firstTurn = true
    private var budgetBlocks = 0
    @Volatile private var generating = false
    private var note = ""

    private lateinit var transcript: TextView
    private lateinit var scroll: ScrollView
    private lateinit var input: EditText
    private lateinit var send: Button
    private lateinit var clear: Button
    private lateinit var stop: Button
    private lateinit var statsView: TextView
    private lateinit var budgetInput: EditText

    private val modelDir: File get() = File(filesDir, "model")

    override fun onCreate(savedInstanceState: Bundle?) {
        super.onCreate(savedInstanceState)
        buildViews()
        startRunner()
        ui.post(object : Runnable {
            override fun run() {
                refreshStats()
                ui.postDelayed(this, 500)
            }
        })
    }

    // ---- pool budget ------------------------------------------------------------------------

    private fun settingMiB(): Long = getPreferences(Context.MODE_PRIVATE).getLong("budget_mib", 64L)

    /** The smaller of the setting and a quarter of what the system says is available above its low-memory threshold. */
    private fun budgetBytes(): Long {
        val info = ActivityManager.MemoryInfo()
        (getSystemService(Context.ACTIVITY_SERVICE) as ActivityManager).getMemoryInfo(info)
        val headroom = ((info.availMem - info.threshold) / 4).coerceAtLeast(4L shl 20)
        return minOf(settingMiB() shl 20, headroom)
    }

    private fun startRunner() {
        val dir = modelDir
        if (!File(dir, "pagedkv.json").isFile) {
            append(getString(R.string.no_model, dir.absolutePath) + "\n")
            setBusy(true)
            return
        }
        val budget = budgetBytes()
        append("Preallocating a ${budget shr 20} MiB KV pool and loading the model...\n")
        setBusy(true)
        worker.execute {
            try {
                val old = runner
                runner = null
                old?.close()
                val r = NativeRunner(dir.absolutePath, budget, 0)
                conversation = r.newConversation()
                firstTurn = true
                budgetBlocks = r.stats().usableBlocks
                runner = r
                ui.post {
                    append("Ready: ${r.stats()}\n\n")
                    setBusy(false)
                }
            } catch (e: PagedKVException) {
                ui.post { append("Could not start: ${e.message}\n") }
            }
        }
    }

    // ---- chat -------------------------------------------------------------------------------

    private fun sendMessage() {
        val r = runner ?: return
        val text = input.text.toString().trim()
        if (text.isEmpty() || generating) return
        input.setText("")
        append("You: $text\nModel: ")
        setBusy(true)
        generating = true
        worker.execute {
            try {
                if (r.stats().usableBlocks < budgetBlocks) r.grow(budgetBlocks)  // trimmed earlier: take it back
                r.chat(conversation, text, firstTurn, 256, 0.7f) { _, piece ->
                    ui.post { append(piece) }
                    true
                }
                firstTurn = false
                ui.post { append("\n\n") }
            } catch (e: PoolExhaustedException) {
                ui.post { append("\n[KV pool full: ${e.message} Press Clear to start over.]\n\n") }
            } catch (e: PagedKVException) {
                ui.post { append("\n[error: ${e.message}]\n\n") }
            } finally {
                generating = false
                ui.post { setBusy(false) }
            }
        }
    }

    private fun clearConversation() {
        val r = runner ?: return
        r.cancel()
        worker.execute {
            r.clear(conversation)  // its blocks go back to the pool at once
            firstTurn = true
            ui.post {
                transcript.text = ""
                append("Cleared: ${r.stats().usedBlocks} blocks in use.\n\n")
            }
        }
    }

    // ---- memory pressure --------------------------------------------------------------------

    override fun onTrimMemory(level: Int) {
        super.onTrimMemory(level)
        val r = runner ?: return
        // Keep a little headroom while the app is in front; give back every free block when it is not.
        val headroom = when {
            level >= ComponentCallbacks2.TRIM_MEMORY_UI_HIDDEN -> 0
            level >= ComponentCallbacks2.TRIM_MEMORY_RUNNING_CRITICAL -> 0
            level >= ComponentCallbacks2.TRIM_MEMORY_RUNNING_LOW -> 4
            else -> 16
        }
        worker.execute {
            val res = r.shrink(r.stats().usedBlocks + headroom)
            note = "onTrimMemory($level): usable ${res.usableBefore} -> ${res.usableAfter} blocks, " +
                "released ${res.releasedBytes shr 10} KiB" +
                (if (res.blockedByUsed > 0) ", ${res.blockedByUsed} used block(s) above the target" else "")
        }
    }

    override fun onDestroy() {
        runner?.cancel()
        val r = runner
        runner = null
        worker.execute { r?.close() }
        worker.shutdown()
        super.onDestroy()
    }

    // ---- views ------------------------------------------------------------------------------

    private fun refreshStats() {
        val r = runner
        val s = if (r == null) "pool: not loaded" else try {
            val st = r.stats()
            "blocks: ${st.usedBlocks} used, ${st.freeBlocks} free, ${st.usableBlocks}/${st.totalBlocks} usable " +
                "(${st.blockSize} tokens each)\n" +
                "KV in use: %.2f MiB   pool committed: %.2f MiB in %d allocations (largest %.2f MiB)\n".format(
                    st.kvBytesInUse / 1048576.0, st.committedBytes / 1048576.0, st.numAllocations,
                    st.largestAllocationBytes / 1048576.0) +
                "prefill %.1f tok/s   decode %.1f tok/s   kernels: %s".format(
                    st.prefillTokPerS, st.decodeTokPerS, st.isa)
        } catch (e: PagedKVException) {
            "pool: ${e.message}"
        }
        statsView.text = if (note.isEmpty()) s else "$s\n$note"
    }

    private fun append(text: String) {
        transcript.append(text)
        scroll.post { scroll.fullScroll(ScrollView.FOCUS_DOWN) }
    }

    private fun setBusy(busy: Boolean) {
        send.isEnabled = !busy && runner != null
        clear.isEnabled = runner != null
        stop.isEnabled = busy && runner != null
    }

    private fun buildViews() {
        val pad = (8 * resources.displayMetrics.density).toInt()
        val root = LinearLayout(this).apply {
            orientation = LinearLayout.VERTICAL
            setPadding(pad, pad, pad, pad)
        }
        statsView = TextView(this).apply { textSize = 11f }
        val budgetRow = LinearLayout(this).apply { orientation = LinearLayout.HORIZONTAL }
        budgetRow.addView(TextView(this).apply { text = getString(R.string.budget_label) })
        budgetInput = EditText(this).apply {
            inputType = InputType.TYPE_CLASS_NUMBER
            setText(settingMiB().toString())
        }
        budgetRow.addView(budgetInput, LinearLayout.LayoutParams(0, WRAP_CONTENT, 1f))
        budgetRow.addView(Button(this).apply {
            text = getString(R.string.apply)
            setOnClickListener {
                val mib = budgetInput.text.toString().toLongOrNull()?.coerceIn(1L, 4096L) ?: return@setOnClickListener
                getPreferences(Context.MODE_PRIVATE).edit().putLong("budget_mib", mib).apply()
                if (!generating) {
                    transcript.text = ""
                    startRunner()  // a new pool, preallocated with the new budget
                }
            }
        })
        transcript = TextView(this).apply { setTextIsSelectable(true) }
        scroll = ScrollView(this).apply { addView(transcript) }
        input = EditText(this).apply { hint = getString(R.string.hint) }
        send = Button(this).apply { text = getString(R.string.send); setOnClickListener { sendMessage() } }
        stop = Button(this).apply { text = getString(R.string.stop); setOnClickListener { runner?.cancel() } }
        clear = Button(this).apply { text = getString(R.string.clear); setOnClickListener { clearConversation() } }
        val row = LinearLayout(this).apply { orientation = LinearLayout.HORIZONTAL }
        row.addView(input, LinearLayout.LayoutParams(0, WRAP_CONTENT, 1f))
        row.addView(send)
        row.addView(stop)
        row.addView(clear)
        root.addView(statsView, LinearLayout.LayoutParams(MATCH_PARENT, WRAP_CONTENT))
        root.addView(budgetRow, LinearLayout.LayoutParams(MATCH_PARENT, WRAP_CONTENT))
        root.addView(scroll, LinearLayout.LayoutParams(MATCH_PARENT, 0, 1f))
        root.addView(row, LinearLayout.LayoutParams(MATCH_PARENT, WRAP_CONTENT))
        setContentView(root)
    }
}
