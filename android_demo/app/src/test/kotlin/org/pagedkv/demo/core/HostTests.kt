package org.pagedkv.demo.core

import java.io.ByteArrayInputStream
import java.io.File
import java.nio.file.Files
import java.util.concurrent.CountDownLatch
import java.util.concurrent.TimeUnit

/**
 * The app's logic on the host JVM (kotlinc from npm + java; no Android, no JUnit):
 *   java -cp CLASSES[:kotlin-stdlib] org.pagedkv.demo.core.HostTestsKt [FIXTURES_DIR]
 * With FIXTURES_DIR (artifacts/ from android_demo/native/tests/make_fixtures.py) and -Djava.library.path
 * pointing at the host build of libpagedkv_jni.so, ChatEngine also runs against the real native runner.
 * Prints PASS/FAIL lines and "N passed, M failed".
 */
private var passed = 0
private var failed = 0

private fun check(ok: Boolean, what: String) {
    if (ok) passed++ else failed++
    println((if (ok) "PASS " else "FAIL ") + what)
}

private fun <T : Throwable> throws(kind: Class<T>, what: String, body: () -> Unit): T? {
    try {
        body()
    } catch (t: Throwable) {
        if (kind.isInstance(t)) {
            check(true, what)
            @Suppress("UNCHECKED_CAST")
            return t as T
        }
        check(false, "$what (threw ${t.javaClass.simpleName}: ${t.message})")
        return null
    }
    check(false, "$what (nothing thrown)")
    return null
}

private const val MiB = 1L shl 20
@Volatile private var hold: CountDownLatch? = null

fun poolPolicyTests() {
    val roomy = MemorySnapshot(availMem = 4096 * MiB, threshold = 256 * MiB, lowMemory = false, lastTrimLevel = 0)
    check(PoolPolicy.budgetBytes(64, roomy) == 64 * MiB, "budget: the setting when memory is plentiful")
    val tight = MemorySnapshot(availMem = 356 * MiB, threshold = 256 * MiB, lowMemory = false, lastTrimLevel = 0)
    check(PoolPolicy.budgetBytes(64, tight) == 25 * MiB, "budget: a quarter of what is above the threshold")
    val none = MemorySnapshot(availMem = 200 * MiB, threshold = 256 * MiB, lowMemory = true, lastTrimLevel = 0)
    check(PoolPolicy.budgetBytes(64, none) == PoolPolicy.MIN_BUDGET_BYTES, "budget: never below the 4 MiB floor")
    check(PoolPolicy.budgetBytes(0, roomy) == MiB, "budget: a setting of 0 means 1 MiB, not an empty pool")

    check(PoolPolicy.keepFreeOnTrim(PoolPolicy.TRIM_MEMORY_BACKGROUND) == 0, "trim BACKGROUND: every free block back")
    check(PoolPolicy.keepFreeOnTrim(80) == 0, "trim COMPLETE (80): every free block back")
    check(PoolPolicy.keepFreeOnTrim(PoolPolicy.TRIM_MEMORY_UI_HIDDEN) == 4, "trim UI_HIDDEN: keep 4 free blocks")
    check(PoolPolicy.keepFreeOnTrim(PoolPolicy.TRIM_MEMORY_RUNNING_LOW) == null,
        "trim RUNNING_* (not sent on Android 14+): left to the check before each turn")

    check(PoolPolicy.usableBeforeTurn(roomy, 100, 10, 5) == 100, "before a turn: grow back to the budget")
    val pressed = roomy.copy(lastTrimLevel = PoolPolicy.TRIM_MEMORY_RUNNING_LOW)
    check(PoolPolicy.usableBeforeTurn(pressed, 100, 10, 5) == 15, "before a turn under pressure (lastTrimLevel): only what the turn needs")
    check(PoolPolicy.usableBeforeTurn(roomy.copy(lowMemory = true), 100, 10, 5) == 15, "before a turn with lowMemory: only what it needs")
    check(PoolPolicy.usableBeforeTurn(pressed, 12, 10, 5) == 12, "never above the budget")
    check(PoolPolicy.blocksForTurn(10, 256, 16) == 18, "blocks for a turn: (prompt + reply) / block, plus one")

    check(CoreCount.performanceCores(listOf(1800000, 1800000, 1800000, 1800000, 2400000, 2400000, 2400000, 3200000)) == 4,
        "threads: the 4 big cores of a 4+3+1 phone")
    check(CoreCount.performanceCores(List(8) { 2000000L }) == 8, "threads: all cores when they are alike")
    check(CoreCount.performanceCores(listOf(0, 0, 0, 0)) == 2, "threads: half the cores when frequencies are unknown")
    val cpu = Files.createTempDirectory("cpu").toFile()
    for ((i, f) in listOf(1000, 1000, 2000, 2000).withIndex()) {
        File(cpu, "cpu$i/cpufreq").mkdirs()
        File(cpu, "cpu$i/cpufreq/cpuinfo_max_freq").writeText("$f\n")
    }
    check(CoreCount.readMaxFreqs(cpu, 5) == listOf(1000L, 1000L, 2000L, 2000L, 0L), "threads: sysfs read, 0 where missing")
    cpu.deleteRecursively()
}

fun transcriptTests() {
    val t = Transcript()
    val a = t.add("hi")
    check(t.active() === a && a.state == Transcript.State.QUEUED, "a new turn is queued")
    check(t.stop() === a && a.stopRequested, "Stop before the turn starts is recorded on the turn (not lost)")
    t.finish(a, Transcript.State.STOPPED)
    check(t.active() == null && t.stop() == null, "nothing active after it ends; Stop then does nothing")
    val b = t.add("¿qué tal? 😀")
    t.started(b)
    t.append(b, "Bien")
    t.append(b, " \uFFFD")  // a partial UTF-8 tail arrives from the runner as U+FFFD
    check(t.render().endsWith("You: ¿qué tal? 😀\nModel: Bien \uFFFD▍\n\n"), "a running turn renders with a cursor")
    t.finish(b, Transcript.State.DONE)
    val c = t.add("more")
    t.finish(c, Transcript.State.FAILED, "KV pool full")
    val r = t.render()
    check(r.contains("You: hi\nModel:  [stopped]\n") && r.contains("Model: Bien \uFFFD\n\n") && r.contains("Model:  [KV pool full]"),
        "rendered transcript: stopped, done, failed turns")
    t.note("Cleared.")
    t.clear()
    check(t.size() == 0 && t.render().isEmpty(), "clear empties the transcript")
}

private fun manifest(pteSha: String?, tok: List<String> = listOf("tokenizer.json")): String {
    val sha = if (pteSha == null) "" else ", \"sha256\": \"$pteSha\""
    return "{\"format_version\": 1, \"artifacts\": {\"pte\": {\"file\": \"model.pte\"$sha}}, \"tokenizer_files\": [" +
        tok.joinToString(", ") { "\"" + it.replace("\"", "\\\"") + "\"" } + "], \"x\": [1, 2.5, true, null, \"\\u00e9\"]}"
}

private fun writeModel(dir: File, pte: ByteArray = byteArrayOf(1, 2, 3), tamperPte: Boolean = false): File {
    dir.mkdirs()
    File(dir, "model.pte").writeBytes(pte)
    File(dir, "tokenizer.json").writeText("{}")
    val m = manifest(ModelFiles.sha256(ByteArrayInputStream(pte)))
    File(dir, "pagedkv.json").writeText(m)
    File(dir, "pagedkv.json.sha256").writeText(ModelFiles.sha256(File(dir, "pagedkv.json")) + "  pagedkv.json\n")
    if (tamperPte) File(dir, "model.pte").writeBytes(byteArrayOf(9))
    return dir
}

fun modelFilesTests() {
    val tmp = Files.createTempDirectory("model").toFile()
    check(MiniJson.parse("{\"a\": [1, -2.5e1, \"x\\n\\u00e9\", {}], \"b\": null}") ==
        mapOf("a" to listOf(1L, -25.0, "x\né", emptyMap<String, Any?>()), "b" to null), "MiniJson reads the manifest's JSON")
    throws(ModelFiles.ImportError::class.java, "a manifest that is not JSON is refused") { ModelFiles.parseManifest("{\"a\": ") }
    val l = ModelFiles.parseManifest(manifest("ab", listOf("tokenizer_config.json", "tokenizer.json")))
    check(l.files == listOf("pagedkv.json", "pagedkv.json.sha256", "model.pte", "tokenizer_config.json", "tokenizer.json"),
        "the files of a model, manifest first")
    for (bad in listOf("x; do touch pwned; done; for f in y", "../etc/passwd", "a/b", "-rf", "")) {
        throws(ModelFiles.ImportError::class.java, "a tokenizer file named '$bad' is refused") {
            ModelFiles.parseManifest(manifest("ab", listOf("tokenizer.json", bad)))
        }
    }
    throws(ModelFiles.ImportError::class.java, "a manifest without tokenizer.json is refused") {
        ModelFiles.parseManifest(manifest("ab", listOf("vocab.txt")))
    }

    val good = writeModel(File(tmp, "good"))
    check(ModelFiles.check(good).pte == "model.pte", "a complete model dir passes the checks")
    val bad = writeModel(File(tmp, "bad"), tamperPte = true)
    throws(ModelFiles.ImportError::class.java, "a .pte that does not match the manifest's sha256 is refused") { ModelFiles.check(bad) }
    val edited = writeModel(File(tmp, "edited"))
    File(edited, "pagedkv.json").appendText(" ")
    throws(ModelFiles.ImportError::class.java, "an edited manifest (digest mismatch) is refused") { ModelFiles.check(edited) }

    // import: from a "picked folder" (name -> stream), into filesDir/model; a failed import keeps the old model
    val filesDir = File(tmp, "files")
    ModelFiles.import(filesDir) { n -> File(good, n).takeIf { it.isFile }?.inputStream() }
    check(File(filesDir, "model/model.pte").readBytes().contentEquals(byteArrayOf(1, 2, 3)) &&
        !File(filesDir, "model.incoming").exists(), "import copies a checked model into files/model")
    val newer = writeModel(File(tmp, "newer"), pte = byteArrayOf(4, 5))
    ModelFiles.import(filesDir) { n -> File(newer, n).takeIf { it.isFile }?.inputStream() }
    check(File(filesDir, "model/model.pte").readBytes().contentEquals(byteArrayOf(4, 5)) && !File(filesDir, "model.old").exists(),
        "a second import replaces the model")
    throws(ModelFiles.ImportError::class.java, "importing a tampered model fails") {
        ModelFiles.import(filesDir) { n -> File(bad, n).takeIf { it.isFile }?.inputStream() }
    }
    check(File(filesDir, "model/model.pte").readBytes().contentEquals(byteArrayOf(4, 5)) && !File(filesDir, "model.incoming").exists(),
        "a failed import leaves the old model and no partial copy")
    throws(ModelFiles.ImportError::class.java, "a folder without pagedkv.json is refused") { ModelFiles.import(filesDir) { null } }

    // where the app reads its model from
    val ext = writeModel(File(tmp, "ext"))
    check(ModelFiles.choose(File(tmp, "none"), null) == null, "no model anywhere: none")
    check(ModelFiles.choose(File(tmp, "none"), ext) == ext, "only the external files dir (release deploy): that one")
    File(ext, "pagedkv.json").setLastModified(1000)
    File(filesDir, "model/pagedkv.json").setLastModified(2000)
    check(ModelFiles.choose(File(filesDir, "model"), ext) == File(filesDir, "model"), "both: the newer one")
    tmp.deleteRecursively()
}

/** ChatEngine against the real runner (host libpagedkv_jni.so) on the tiny exported model. */
fun engineTests(fixtures: File) {
    val art = File(fixtures, "artifacts")
    val roomy = MemorySnapshot(4096 * MiB, 256 * MiB, false, 0)
    var changes = 0
    val engine = ChatEngine {
        synchronized(art) { changes++ }
        if (Thread.currentThread().name == "pagedkv-runner") hold?.await(30, TimeUnit.SECONDS)
    }
    engine.maxNewTokens = 12
    engine.temperature = 0f
    check(engine.send("too early") { roomy } == null, "Send before the model is loaded does nothing")
    engine.start(art, 0, 2)
    waitIdle(engine)
    check(engine.ready && engine.stats!!.totalBlocks > 0, "the runner starts on the engine's thread (${engine.status})")

    // One turn at a time: the executor is held (a task's onChange waits on `hold`), so the first turn is
    // still queued when the second Send comes, however fast the tiny model would have answered it
    hold = CountDownLatch(1)
    engine.refreshStats()
    val first = engine.send("Hello there") { roomy }
    check(first != null && engine.send("queued while busy") { roomy } == null, "one turn at a time")
    hold!!.countDown()
    hold = null
    val w = waitDone(engine, first!!)
    check(w && first.state == Transcript.State.DONE && first.replyText.isNotEmpty(), "a turn streams its reply (${first.replyText.length} chars)")
    val used = engine.stats!!.usedBlocks
    check(used > 0, "the conversation holds blocks ($used)")

    // Stop pressed while the turn waits behind another task: it never starts (the reply stays empty)
    hold = CountDownLatch(1)
    engine.refreshStats()  // its onChange blocks the engine's thread until `hold` opens
    val second = engine.send("Stop me before I start") { roomy }!!
    check(second.state == Transcript.State.QUEUED, "the turn waits behind the held task")
    check(engine.stop(), "Stop finds the queued turn")
    hold!!.countDown()
    hold = null
    waitDone(engine, second)
    check(second.state == Transcript.State.STOPPED && second.replyText.isEmpty(),
        "a Stop before the turn starts is not lost (state ${second.state}, reply '${second.replyText}')")
    // Stop while it runs: the listener returns false after the current token
    val running = engine.send("Stop me while I run") { roomy }!!
    while (running.replyText.isEmpty() && running.state != Transcript.State.DONE) Thread.sleep(1)
    engine.stop()
    waitDone(engine, running)
    check(running.state == Transcript.State.STOPPED || running.state == Transcript.State.DONE, "a running turn ends on Stop")

    engine.trim(PoolPolicy.TRIM_MEMORY_BACKGROUND)
    engine.refreshStats()
    waitIdle(engine)
    val s = engine.stats!!
    check(s.usableBlocks == s.usedBlocks, "trim BACKGROUND shrinks the pool to the used blocks (${s.usableBlocks}/${s.usedBlocks})")
    val third = engine.send("and again") { roomy }!!
    waitDone(engine, third)
    check(third.state == Transcript.State.DONE && engine.stats!!.usableBlocks > s.usableBlocks,
        "the next turn grows the pool back (${third.state} ${third.note} ${third.replyText.length} chars, usable ${s.usableBlocks} -> " +
            "${engine.stats!!.usableBlocks}, status '${engine.status}')")
    engine.clear()
    waitIdle(engine)
    check(engine.stats!!.usedBlocks == 0, "Clear releases the conversation's blocks")

    val pressed = engine.send("under pressure") { roomy.copy(lowMemory = true) }!!
    waitDone(engine, pressed)
    check(pressed.state == Transcript.State.DONE, "a turn under memory pressure still runs")

    engine.close(awaitMs = 10_000)
    check(engine.closed && engine.send("after close") { roomy } == null, "close goes through the executor; nothing runs after it")
    engine.refreshStats()  // must not touch the closed runner (no crash, no task)
    check(changes > 0, "the engine reported changes to its listener")

    // errors become notes, not crashes: a missing model dir
    val broken = ChatEngine { }
    broken.start(File(fixtures, "no-such-dir"), 0, 1)
    waitIdle(broken)
    broken.close(awaitMs = 10_000)
    check(broken.status.startsWith("loading the model failed: PagedKVException"), "a failed start is shown: ${broken.status}")
}

/**
 * The app's save/restore (onStop / onTrimMemory save, start restores) through the real runner: the chat
 * comes back with its blocks and messages (the next turn prefills only its new tokens), a damaged file
 * is a note and a fresh conversation with the pool untouched, Clear deletes the file.
 */
fun saveRestoreTests(fixtures: File) {
    val art = File(fixtures, "artifacts")
    val roomy = MemorySnapshot(4096 * MiB, 256 * MiB, false, 0)
    val dir = Files.createTempDirectory("pagedkv-save").toFile()
    val file = File(dir, "chat.pkvc")
    fun engine() = ChatEngine { }.also { it.maxNewTokens = 12; it.temperature = 0f; it.saveFile = file }

    val a = engine()
    a.start(art, 0, 2)
    waitIdle(a)
    check(a.ready && !file.exists(), "no saved chat: the engine starts a new conversation")
    waitDone(a, a.send("Hello there") { roomy }!!)
    a.trim(PoolPolicy.TRIM_MEMORY_BACKGROUND)  // onTrimMemory: save first, then shrink
    a.refreshStats()
    waitIdle(a)
    val afterTrim = file.length()
    check(file.isFile && afterTrim > 0 && a.stats!!.usableBlocks == a.stats!!.usedBlocks,
        "trim saves the chat ($afterTrim bytes) and shrinks the pool (${a.stats!!.usableBlocks}/${a.stats!!.usedBlocks})")
    waitDone(a, a.send("Tell me more") { roomy }!!)
    a.save()  // onStop
    a.refreshStats()
    waitIdle(a)
    val used = a.stats!!.usedBlocks
    check(file.length() > afterTrim, "onStop's save writes the longer chat (${file.length()} > $afterTrim bytes)")
    // what the saved chat does next without a restart: its reply and the tokens that turn prefills
    val before = a.stats!!.prefillTokens
    val goOn = a.send("and again") { roomy }!!
    waitDone(a, goOn)
    a.refreshStats()
    waitIdle(a)
    val wantPrefill = a.stats!!.prefillTokens - before
    a.close(awaitMs = 10_000)

    val b = engine()  // the next process start
    b.start(art, 0, 2)
    waitIdle(b)
    val st = b.stats!!
    check(b.ready && st.usedBlocks == used && st.prefillTokens == 0L && "Restored the saved chat" in b.transcript.render(),
        "start restores the saved chat without prefill (${st.usedBlocks} of $used blocks, ${st.prefillTokens} prefilled; " +
            "notes: ${b.transcript.render().lines().filter { it.startsWith("[") }.joinToString(" ")})")
    val next = b.send("and again") { roomy }!!
    waitDone(b, next)
    b.refreshStats()
    waitIdle(b)
    // the same messages and cache: the same turn prefills the same tokens and replies the same (greedy)
    check(next.state == Transcript.State.DONE && next.replyText == goOn.replyText && b.stats!!.prefillTokens == wantPrefill,
        "the restored chat continues as the saved one would (prefilled ${b.stats!!.prefillTokens} vs $wantPrefill tokens, " +
            "reply '${next.replyText}' vs '${goOn.replyText}')")
    b.close(awaitMs = 10_000)

    val bytes = file.readBytes()
    file.writeBytes(bytes.copyOf(bytes.size / 2))  // damaged (a crash mid-copy, a full disk)
    val c = engine()
    c.start(art, 0, 2)
    waitIdle(c)
    check(c.ready && c.stats!!.usedBlocks == 0 && "The saved chat was not restored" in c.transcript.render() &&
        "checksum mismatch" in c.transcript.render(), "a damaged file is a note and a new conversation, the pool untouched")
    val fresh = c.send("Hello there") { roomy }!!
    waitDone(c, fresh)
    check(fresh.state == Transcript.State.DONE, "the runner works after refusing the file")
    c.clear()
    waitIdle(c)
    check(!file.exists(), "Clear deletes the saved chat: it does not come back on the next start")
    c.close(awaitMs = 10_000)
    dir.deleteRecursively()
}

/**
 * trim's compact tier (issue 25) through the real runner. On a .pte with a compact region: trim BACKGROUND
 * moves the conversation's aged blocks into it (stats' compactBlocksInUse counts them; the default blocks in
 * use fall by as many), saves, then shrinks; a new process restores that compacted file without prefill and its
 * next greedy turn is the one the trimmed engine gives. On a .pte without one: trim skips compaction.
 */
private const val story = "The river ran through the old town , past the mill and the church , and the children " +
    "of the valley played on its banks every summer until the autumn rains came down from the hills ."

fun compactTrimTests(fixtures: File) {
    val art = File(fixtures, "artifacts")
    val roomy = MemorySnapshot(4096 * MiB, 256 * MiB, false, 0)
    val dir = Files.createTempDirectory("pagedkv-compact").toFile()
    val file = File(dir, "chat.pkvc")
    fun engine() = ChatEngine { }.also {
        it.maxNewTokens = 1; it.temperature = 0f; it.saveFile = file; it.compactHorizon = 16; it.spillDir = dir
    }

    val a = engine()
    a.start(art, 0, 1)
    waitIdle(a)
    if (a.stats!!.compactBlocks == 0) {
        waitDone(a, a.send("Hello there, tell me a story about the river") { roomy }!!)
        a.trim(PoolPolicy.TRIM_MEMORY_BACKGROUND)
        a.refreshStats()
        waitIdle(a)
        val s = a.stats!!
        check(s.compactBlocksInUse == 0 && a.status.startsWith("trim level 40: usable") &&
            s.usableBlocks == s.usedBlocks && file.isFile,
            "trim without a compact region skips compaction, saves and shrinks (${a.status})")
        a.close(awaitMs = 10_000)
        dir.deleteRecursively()
        return
    }
    // a long message and a one-token reply: the next turn's re-render matches the cache (the tiny model's
    // replies are noise that the tiny tokenizer does not always encode back to the same ids)
    waitDone(a, a.send(story) { roomy }!!)
    a.refreshStats()
    waitIdle(a)
    val before = a.stats!!
    check(before.compactBlocksInUse == 0 && before.usedBlocks > 2, "a turn in a roomy pool compacts nothing (${before.usedBlocks} blocks)")
    a.trim(PoolPolicy.TRIM_MEMORY_UI_HIDDEN - 1)  // a RUNNING_* level: save only, nothing compacted
    a.refreshStats()
    waitIdle(a)
    check(a.stats!!.compactBlocksInUse == 0 && file.isFile, "trim below UI_HIDDEN saves without compacting")
    a.trim(PoolPolicy.TRIM_MEMORY_BACKGROUND)
    a.refreshStats()
    waitIdle(a)
    val s = a.stats!!
    // Runner::compact called directly is not a ladder rung (compactions/compacted_blocks count the rungs a turn
    // takes); the compact blocks the conversation holds are the ones trim moved.
    val moved = s.compactBlocksInUse
    // The default blocks compaction freed are the oldest (low ids): the shrink moves the used blocks above
    // them down into them, so the limit falls to the blocks in use and the pages above it are released.
    check(moved > 0 && s.usedBlocks == before.usedBlocks - moved && s.usableBlocks == s.usedBlocks &&
        a.status.startsWith("trim level 40: $moved aged block(s) compacted"),
        "trim compacts aged blocks, then shrinks ($moved moved, used ${before.usedBlocks} -> ${s.usedBlocks}, " +
            "usable ${s.usableBlocks}: ${a.status})")
    val saved = file.readBytes()
    val prefill0 = s.prefillTokens
    val goOn = a.send("and then what happened") { roomy }!!
    waitDone(a, goOn)
    a.refreshStats()
    waitIdle(a)
    val wantPrefill = a.stats!!.prefillTokens - prefill0
    // (the tiny tokenizer does not encode the tiny model's reply back to the same ids, so chat() re-renders a
    // conversation that differs from its cache and starts it over; runnerCompactTests checks the cache kept)
    check(goOn.state == Transcript.State.DONE,
        "the turn after the trim runs (${goOn.replyText.length} chars, " +
            "${a.stats!!.compactBlocksInUse} compact blocks in use, prefilled $wantPrefill tokens)")
    a.close(awaitMs = 10_000)

    file.writeBytes(saved)  // what the trim saved: the compacted conversation
    val b = engine()  // the process Android killed after the trim, started again
    b.start(art, 0, 1)
    waitIdle(b)
    val r = b.stats!!
    check(b.ready && r.compactBlocksInUse == moved && r.usedBlocks == s.usedBlocks && r.prefillTokens == 0L,
        "start restores the compacted chat without prefill (${r.compactBlocksInUse} compact, ${r.usedBlocks} default blocks)")
    val next = b.send("and then what happened") { roomy }!!
    waitDone(b, next)
    b.refreshStats()
    waitIdle(b)
    check(next.state == Transcript.State.DONE && next.replyText == goOn.replyText && b.stats!!.prefillTokens == wantPrefill,
        "the restored compacted chat continues as the trimmed one did (reply '${next.replyText}' vs '${goOn.replyText}')")
    b.close(awaitMs = 10_000)
    dir.deleteRecursively()
}

/** NativeRunner.compact on the cache generate() extends (no re-render): the next greedy tokens prefill only the
 *  new ids over the compacted blocks, and a runner that restores the compacted file gives the same tokens. */
fun runnerCompactTests(fixtures: File) {
    val art = File(fixtures, "artifacts").absolutePath
    val file = Files.createTempFile("pagedkv-compact", ".pkvc").toFile()
    org.pagedkv.demo.NativeRunner(art, 0, 1, "", "adaptive", 16, "").use { r ->
        val c = r.newConversation()
        val ids = r.encode(story)
        r.generate(c, ids, 1, 0f, 0, 1f, 0, null)
        if (r.stats().compactBlocks == 0) {
            throws(org.pagedkv.demo.PagedKVException::class.java, "compact on a .pte without a compact region throws") {
                r.compact(c, 16)
            }
            return
        }
        val used = r.stats().usedBlocks
        val moved = r.compact(c, 16)
        check(moved > 0 && r.stats().compactBlocksInUse == moved && r.stats().usedBlocks == used - moved,
            "NativeRunner.compact moves aged blocks ($moved, default blocks $used -> ${r.stats().usedBlocks})")
        r.save(c, file.absolutePath)
        val more = r.encode(" and the mill")
        val p0 = r.stats().prefillTokens
        val want = r.generate(c, more, 8, 0f, 0, 1f, 0, null)
        check(r.stats().prefillTokens - p0 == more.size.toLong() + 1 && r.stats().compactBlocksInUse == moved,
            "generate after compact prefills only the new ids over the compact blocks (${r.stats().prefillTokens - p0})")
        org.pagedkv.demo.NativeRunner(art, 0, 1, "", "adaptive", 16, "").use { b ->
            val rc = b.restore(file.absolutePath)
            val got = b.generate(rc, more, 8, 0f, 0, 1f, 0, null)
            check(b.stats().compactBlocksInUse == moved && got.contentEquals(want),
                "the restored compacted cache gives the same greedy tokens (${got.toList()} vs ${want.toList()})")
        }
    }
    file.delete()
}

private fun waitDone(engine: ChatEngine, turn: Transcript.Turn): Boolean {
    val deadline = System.currentTimeMillis() + 120_000
    while ((turn.state == Transcript.State.QUEUED || turn.state == Transcript.State.RUNNING) && System.currentTimeMillis() < deadline)
        Thread.sleep(10)
    waitIdle(engine)
    return turn.state != Transcript.State.QUEUED && turn.state != Transcript.State.RUNNING
}

private fun waitIdle(engine: ChatEngine) {
    check(engine.awaitIdle(120_000), "the engine's queue drains")
}

fun main(args: Array<String>) {
    poolPolicyTests()
    transcriptTests()
    modelFilesTests()
    if (args.isNotEmpty()) {
        engineTests(File(args[0]))
        saveRestoreTests(File(args[0]))
        compactTrimTests(File(args[0]))
        runnerCompactTests(File(args[0]))
    }
    println("$passed passed, $failed failed")
    if (failed > 0) kotlin.system.exitProcess(1)
}
