package org.pagedkv.demo;

/**
 * The pagedkv native runner (libpagedkv_jni.so over libpagedkv_runner.so): ExecuTorch + the pagedkv
 * kernels + a KV block pool preallocated at construction. No Android imports, so it runs on a host
 * JVM too. Not thread safe for generation: one thread generates at a time; {@link #stats()} and
 * {@link #cancel()} may be called from any thread.
 */
public final class NativeRunner implements AutoCloseable {
    private static boolean loaded;

    /** Loads libpagedkv_jni from java.library.path (System.loadLibrary), once. */
    public static synchronized void loadLibrary() {
        if (!loaded) {
            System.loadLibrary("pagedkv_jni");
            loaded = true;
        }
    }

    /** Receives each generated token and the text it completes; return false to stop. */
    public interface TokenListener {
        boolean onToken(int tokenId, String text);
    }

    /** Pool and speed figures; see PoolStats in runner.h. */
    public static final class Stats {
        public int totalBlocks, usableBlocks, usedBlocks, freeBlocks, blockSize, sequences, numAllocations;
        public long kvBytesInUse, bytesPerBlock, committedBytes, reservedBytes, largestAllocationBytes;
        public long prefillTokens, decodeTokens;
        public double prefillTokPerS, decodeTokPerS;
        public String isa;
        /** The compact region (a .pte exported with --compact-blocks N; 0 blocks without one) and its bytes. */
        public int compactBlocks;
        public long compactBytes;
        /** The pressure ladder's rungs taken (runner.h LadderStats, runtime_sim Engine.stats()["ladder"] names). */
        public long slides, spills, spillBytes, spillFailures, restoresFromSpill, spillReprefills;
        public int spilledNow, compactBlocksInUse;
        public long compactions, compactedBlocks;

        static Stats fromArray(double[] v, String isa) {
            Stats s = new Stats();
            s.totalBlocks = (int) v[0];
            s.usableBlocks = (int) v[1];
            s.usedBlocks = (int) v[2];
            s.freeBlocks = (int) v[3];
            s.blockSize = (int) v[4];
            s.sequences = (int) v[5];
            s.kvBytesInUse = (long) v[6];
            s.bytesPerBlock = (long) v[7];
            s.committedBytes = (long) v[8];
            s.reservedBytes = (long) v[9];
            s.largestAllocationBytes = (long) v[10];
            s.numAllocations = (int) v[11];
            s.prefillTokens = (long) v[12];
            s.decodeTokens = (long) v[13];
            s.prefillTokPerS = v[14];
            s.decodeTokPerS = v[15];
            s.compactBlocks = (int) v[16];
            s.compactBytes = (long) v[17];
            s.slides = (long) v[18];
            s.spills = (long) v[19];
            s.spillBytes = (long) v[20];
            s.spillFailures = (long) v[21];
            s.restoresFromSpill = (long) v[22];
            s.spillReprefills = (long) v[23];
            s.spilledNow = (int) v[24];
            s.compactions = (long) v[25];
            s.compactedBlocks = (long) v[26];
            s.compactBlocksInUse = (int) v[27];
            s.isa = isa;
            return s;
        }

        @Override
        public String toString() {
            return String.format(
                    "blocks %d used / %d free / %d usable / %d total (x%d tokens), KV %.2f MiB in use, "
                            + "pool %.2f MiB committed in %d allocations (largest %.2f MiB), "
                            + "prefill %.1f tok/s, decode %.1f tok/s, kernels %s%s",
                    usedBlocks, freeBlocks, usableBlocks, totalBlocks, blockSize, kvBytesInUse / 1048576.0,
                    committedBytes / 1048576.0, numAllocations, largestAllocationBytes / 1048576.0,
                    prefillTokPerS, decodeTokPerS, isa,
                    compactBlocks == 0 ? "" : String.format(", compact %d / %d blocks in use (%d moved)",
                            compactBlocksInUse, compactBlocks, compactedBlocks)
                    + (spills == 0 && slides == 0 ? "" : String.format(", %d spilled, %d slid", spills, slides)));
        }
    }

    /** What {@link #shrink(int)} did. */
    public static final class ShrinkResult {
        public final int requestedBlocks, usableBefore, usableAfter, blockedByUsed;
        public final long releasedBytes;

        ShrinkResult(long[] v) {
            requestedBlocks = (int) v[0];
            usableBefore = (int) v[1];
            usableAfter = (int) v[2];
            blockedByUsed = (int) v[3];
            releasedBytes = v[4];
        }
    }

    private volatile long handle;

    /**
     * Loads the artifacts dir (model.pte, pagedkv.json, tokenizer.json) and preallocates the pool.
     *
     * @param poolBudgetBytes bytes for KV blocks; 0 = every block the .pte holds
     * @param numThreads kernel threads; 0 = default
     */
    public NativeRunner(String artifactsDir, long poolBudgetBytes, int numThreads) {
        this(artifactsDir, poolBudgetBytes, numThreads, "");
    }

    /** As above; isa forces a kernel code path ("scalar", "neon", ...), "" = best available. */
    public NativeRunner(String artifactsDir, long poolBudgetBytes, int numThreads, String isa) {
        this(artifactsDir, poolBudgetBytes, numThreads, isa, "error", 1024, "");
    }

    /**
     * As above, with the pool's pressure policy (RunnerConfig::policy): "error" (a turn that needs blocks that
     * are not free throws PoolExhaustedException), "sliding" (old blocks dropped) or "adaptive" (the ladder:
     * aged blocks, those ending at least compactHorizon tokens back, re-quantized into the compact region when
     * the .pte has one; idle conversations spilled to spillDir, "" = never; then sliding).
     */
    public NativeRunner(String artifactsDir, long poolBudgetBytes, int numThreads, String isa, String policy,
                        int compactHorizon, String spillDir) {
        loadLibrary();
        handle = nativeCreate(artifactsDir, poolBudgetBytes, numThreads, isa, policy, compactHorizon, spillDir);
    }

    public int newConversation() { return nativeNewConversation(handle); }

    /** Releases the conversation's blocks; it stays usable and starts empty. */
    public void clear(int conversation) { nativeClear(handle, conversation); }

    public void closeConversation(int conversation) { nativeCloseConversation(handle, conversation); }

    /** Writes the conversation (its KV blocks, tokens and messages) to path, atomically; returns its size in bytes. */
    public long save(int conversation, String path) { return nativeSave(handle, conversation, path); }

    /**
     * Re-quantizes the conversation's aged blocks (past the sink, ending at least horizon tokens back) into
     * free blocks of the .pte's compact region, freeing as many default blocks; returns how many moved.
     * A .pte without a compact region ({@link Stats#compactBlocks} 0) throws PagedKVException (ARGUMENT).
     */
    public int compact(int conversation, int horizon) { return nativeCompact(handle, conversation, horizon); }

    /** A new conversation restored from a file save wrote (no prefill); a bad file throws, nothing changed. */
    public int restore(String path) { return nativeRestore(handle, path); }

    /** Prefills promptIds after the conversation's history and streams up to maxNewTokens tokens. */
    public int[] generate(int conversation, int[] promptIds, int maxNewTokens, float temperature, int topK,
                          float topP, long seed, TokenListener listener) {
        return nativeGenerate(handle, conversation, promptIds, maxNewTokens, temperature, topK, topP, seed, listener);
    }

    /**
     * One chat turn: the conversation so far plus userText rendered with the model's chat template (from
     * the artifacts), only the tokens not yet cached prefilled, then up to maxNewTokens streamed. Ends at a
     * stop token (the manifest's), the cap, or when the listener returns false.
     */
    public int[] chat(int conversation, String userText, int maxNewTokens, float temperature, TokenListener listener) {
        return nativeChat(handle, conversation, userText, maxNewTokens, temperature, 40, 0.95f, System.nanoTime(),
                listener);
    }

    /** The text chat() would prefill for userText (the whole conversation, rendered). */
    public String renderChat(int conversation, String userText) {
        return nativeRenderChat(handle, conversation, userText);
    }

    public int[] encode(String text) { return nativeEncode(handle, text); }

    public String decode(int[] ids) { return nativeDecode(handle, ids); }

    public int[] stopTokens() { return nativeStopTokens(handle); }

    /** Stops a running generate after its current step (any thread). */
    public void cancel() { nativeCancel(handle); }

    /** Lowers the usable block count towards target (not below the used blocks) and releases free pages. */
    public ShrinkResult shrink(int targetUsableBlocks) { return new ShrinkResult(nativeShrink(handle, targetUsableBlocks)); }

    /** Raises the usable block count again (re-commits its pages); returns the new count. */
    public int grow(int targetUsableBlocks) { return nativeGrow(handle, targetUsableBlocks); }

    public Stats stats() { return Stats.fromArray(nativeStats(handle), nativeIsa(handle)); }

    @Override
    public synchronized void close() {
        long h = handle;
        handle = 0;
        if (h != 0) nativeDestroy(h);
    }

    private static native long nativeCreate(String dir, long budget, int threads, String isa, String policy,
                                            int horizon, String spillDir);
    private static native int nativeCompact(long h, int conv, int horizon);
    private static native void nativeDestroy(long h);
    private static native int nativeNewConversation(long h);
    private static native void nativeClear(long h, int conv);
    private static native void nativeCloseConversation(long h, int conv);
    private static native long nativeSave(long h, int conv, String path);
    private static native int nativeRestore(long h, String path);
    private static native int[] nativeGenerate(long h, int conv, int[] prompt, int maxNew, float temperature, int topK,
                                               float topP, long seed, TokenListener listener);
    private static native int[] nativeChat(long h, int conv, String text, int maxNew, float temperature, int topK,
                                           float topP, long seed, TokenListener listener);
    private static native String nativeRenderChat(long h, int conv, String text);
    private static native int[] nativeEncode(long h, String text);
    private static native String nativeDecode(long h, int[] ids);
    private static native void nativeCancel(long h);
    private static native long[] nativeShrink(long h, int target);
    private static native int nativeGrow(long h, int target);
    private static native double[] nativeStats(long h);
    private static native String nativeIsa(long h);
    private static native int[] nativeStopTokens(long h);
}
