package org.pagedkv.demo

import android.app.Activity
import android.content.Intent
import android.net.Uri
import android.os.Bundle
import android.os.Handler
import android.os.Looper
import android.provider.DocumentsContract
import android.text.InputType
import android.view.ViewGroup.LayoutParams.MATCH_PARENT
import android.view.ViewGroup.LayoutParams.WRAP_CONTENT
import android.widget.Button
import android.widget.EditText
import android.widget.LinearLayout
import android.widget.ScrollView
import android.widget.TextView
import androidx.appcompat.app.AppCompatActivity
import org.pagedkv.demo.core.ChatEngine
import org.pagedkv.demo.core.ModelFiles
import java.io.InputStream
import java.util.concurrent.Executors

/**
 * The chat screen: a thin shell over the app's [ChatEngine] (PagedKVApp). It holds no runner and no
 * chat state, so rotation re-creates only views; the stats loop runs between onStart and onStop.
 */
class MainActivity : AppCompatActivity() {
    private val app get() = application as PagedKVApp
    private val engine get() = app.engine
    private val ui = Handler(Looper.getMainLooper())
    private val redraw: () -> Unit = { render() }
    private val statsLoop = object : Runnable {
        override fun run() {
            engine.refreshStats()
            ui.postDelayed(this, 500)
        }
    }

    private lateinit var transcript: TextView
    private lateinit var scroll: ScrollView
    private lateinit var input: EditText
    private lateinit var send: Button
    private lateinit var clear: Button
    private lateinit var stop: Button
    private lateinit var statsView: TextView
    private lateinit var budgetInput: EditText

    override fun onCreate(savedInstanceState: Bundle?) {
        super.onCreate(savedInstanceState)
        buildViews()
        if (savedInstanceState == null && !engine.ready && engine.stats == null) {
            if (!app.startRunner()) engine.transcript.note(getString(R.string.no_model, filesDir.absolutePath + "/model"))
        }
    }

    override fun onStart() {
        super.onStart()
        app.addListener(redraw)
        ui.post(statsLoop)
        render()
    }

    override fun onStop() {
        ui.removeCallbacks(statsLoop)  // the loop stops with the view: no leaked Activity, no work in the background
        app.removeListener(redraw)
        engine.save()  // the chat survives the process: files/chat.pkvc, restored by the next start
        super.onStop()
    }

    // ---- actions ----------------------------------------------------------------------------

    private fun sendMessage() {
        val text = input.text.toString().trim()
        if (text.isEmpty()) return
        if (engine.send(text) { app.memory() } != null) input.setText("")
    }

    private fun applyBudget() {
        val mib = budgetInput.text.toString().toLongOrNull()?.coerceIn(1L, 4096L) ?: return
        app.setSettingMiB(mib)
        engine.stop()
        engine.transcript.clear()
        if (!app.startRunner()) engine.transcript.note(getString(R.string.no_model, filesDir.absolutePath + "/model"))
    }

    /** Import a model: the system picker gives a folder (the artifacts dir); it is copied and checked off the UI thread. */
    private fun pickModel() {
        @Suppress("DEPRECATION")
        startActivityForResult(Intent(Intent.ACTION_OPEN_DOCUMENT_TREE), PICK_MODEL)
    }

    @Deprecated("ActivityResult API would need activity-ktx; this is the platform call")
    override fun onActivityResult(requestCode: Int, resultCode: Int, data: Intent?) {
        @Suppress("DEPRECATION")
        super.onActivityResult(requestCode, resultCode, data)
        val tree = data?.data
        if (requestCode != PICK_MODEL || resultCode != Activity.RESULT_OK || tree == null) return
        engine.transcript.note("Importing the model...")
        render()
        val appRef = app
        importer.execute {
            val msg = try {
                val names = listChildren(tree)
                val listing = ModelFiles.import(appRef.filesDir) { name -> names[name]?.let { openUri(it) } }
                "Imported ${listing.pte} (sha256 checked)."
            } catch (t: Throwable) {
                "Import failed: ${ChatEngine.describe(t)}"
            }
            ui.post {
                engine.transcript.note(msg)
                if (msg.startsWith("Imported")) appRef.startRunner()
                render()
            }
        }
    }

    private fun openUri(uri: Uri): InputStream? = contentResolver.openInputStream(uri)

    /** name -> document uri of the picked folder's files. */
    private fun listChildren(tree: Uri): Map<String, Uri> {
        val dirId = DocumentsContract.getTreeDocumentId(tree)
        val children = DocumentsContract.buildChildDocumentsUriUsingTree(tree, dirId)
        val out = HashMap<String, Uri>()
        contentResolver.query(children, arrayOf(DocumentsContract.Document.COLUMN_DOCUMENT_ID,
            DocumentsContract.Document.COLUMN_DISPLAY_NAME), null, null, null)?.use { c ->
            while (c.moveToNext()) out[c.getString(1)] = DocumentsContract.buildDocumentUriUsingTree(tree, c.getString(0))
        }
        return out
    }

    // ---- views ------------------------------------------------------------------------------

    private fun render() {
        val st = engine.stats
        val s = if (st == null) engine.status else
            "blocks: ${st.usedBlocks} used, ${st.freeBlocks} free, ${st.usableBlocks}/${st.totalBlocks} usable " +
                "(${st.blockSize} tokens each)\n" +
                "KV in use: %.2f MiB   pool committed: %.2f MiB in %d allocations (largest %.2f MiB)\n".format(
                    st.kvBytesInUse / 1048576.0, st.committedBytes / 1048576.0, st.numAllocations,
                    st.largestAllocationBytes / 1048576.0) +
                "prefill %.1f tok/s   decode %.1f tok/s   kernels: %s\n%s".format(
                    st.prefillTokPerS, st.decodeTokPerS, st.isa, engine.status)
        statsView.text = s
        transcript.text = engine.transcript.render()
        scroll.post { scroll.fullScroll(ScrollView.FOCUS_DOWN) }
        val busy = engine.transcript.active() != null
        send.isEnabled = engine.ready && !busy
        stop.isEnabled = busy
        clear.isEnabled = engine.ready
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
            setText(app.settingMiB().toString())
        }
        budgetRow.addView(budgetInput, LinearLayout.LayoutParams(0, WRAP_CONTENT, 1f))
        budgetRow.addView(Button(this).apply { text = getString(R.string.apply); setOnClickListener { applyBudget() } })
        budgetRow.addView(Button(this).apply { text = getString(R.string.import_model); setOnClickListener { pickModel() } })
        transcript = TextView(this).apply { setTextIsSelectable(true) }
        scroll = ScrollView(this).apply { addView(transcript) }
        input = EditText(this).apply { hint = getString(R.string.hint) }
        send = Button(this).apply { text = getString(R.string.send); setOnClickListener { sendMessage() } }
        stop = Button(this).apply { text = getString(R.string.stop); setOnClickListener { engine.stop(); render() } }
        clear = Button(this).apply { text = getString(R.string.clear); setOnClickListener { engine.clear() } }
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

    companion object {
        private const val PICK_MODEL = 1
        private val importer = Executors.newSingleThreadExecutor { r -> Thread(r, "pagedkv-import") }
    }
}
