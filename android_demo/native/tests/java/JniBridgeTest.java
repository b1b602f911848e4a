import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

import org.pagedkv.demo.NativeRunner;
import org.pagedkv.demo.PagedKVException;
import org.pagedkv.demo.PoolExhaustedException;

/**
 * Exercises the JNI bridge on a host JVM:
 *   java -Djava.library.path=BUILD -cp CLASSES JniBridgeTest FIXTURES_DIR
 * FIXTURES_DIR: artifacts/ + expected.json from tests/make_fixtures.py.
 */
public class JniBridgeTest {
    static int passed = 0, failed = 0;

    static void check(boolean ok, String what) {
        if (ok) {
            passed++;
            System.out.println("PASS " + what);
        } else {
            failed++;
            System.out.println("FAIL " + what);
        }
    }

    static int[] intsAfter(String json, String key, int from) {
        int k = json.indexOf("\"" + key + "\"", from);
        int a = json.indexOf('[', k), b = json.indexOf(']', a);
        String[] parts = json.substring(a + 1, b).replaceAll("\\s", "").split(",");
        int[] out = new int[parts.length];
        for (int i = 0; i < parts.length; i++) out[i] = Integer.parseInt(parts[i]);
        return out;
    }

    public static void main(String[] args) throws Exception {
        String fix = args[0];
        String art = fix + "/artifacts";
        String json = new String(Files.readAllBytes(Paths.get(fix, "expected.json")), StandardCharsets.UTF_8);
        int at = json.indexOf("\"cases\"");
        int[] promptIds = intsAfter(json, "prompt_ids", at);
        int[] hf = intsAfter(json, "hf_greedy", at);
        Matcher m = Pattern.compile("\"prompt\": \"((?:[^\"\\\\]|\\\\.)*)\"").matcher(json);
        m.find();
        String prompt = m.group(1).replace("\\\"", "\"").replace("\\\\", "\\");

        try (NativeRunner r = new NativeRunner(art, 0, 0)) {
            NativeRunner.Stats s0 = r.stats();
            System.out.println("stats: " + s0);
            check(s0.totalBlocks > 0 && s0.usableBlocks == s0.totalBlocks && s0.usedBlocks == 0, "preallocated pool");
            check(Arrays.equals(r.encode(prompt), promptIds), "encode equals HF ids");

            int conv = r.newConversation();
            StringBuilder text = new StringBuilder();
            List<Integer> streamed = new ArrayList<>();
            int[] got = r.generate(conv, promptIds, hf.length, 0f, 0, 1f, 0, (id, piece) -> {
                streamed.add(id);
                text.append(piece);
                return true;
            });
            check(Arrays.equals(got, hf), "greedy tokens equal HF: " + Arrays.toString(got));
            check(streamed.size() == hf.length, "every token streamed through the listener");
            check(text.toString().equals(r.decode(got)), "streamed text equals decode()");
            check(r.stats().usedBlocks > 0, "blocks in use after generation");

            int[] early = r.generate(conv, new int[] {5}, 10, 0f, 0, 1f, 0, (id, piece) -> false);
            check(early.length == 1, "listener returning false stops generation");

            r.clear(conv);
            check(r.stats().usedBlocks == 0, "clear releases the blocks");

            NativeRunner.ShrinkResult sr = r.shrink(1);
            check(sr.usableAfter == 1 && sr.releasedBytes > 0, "shrink releases the free part: " + sr.releasedBytes + " bytes");
            try {
                r.generate(conv, promptIds, 4, 0f, 0, 1f, 0, null);
                check(false, "exhaustion throws");
            } catch (PoolExhaustedException e) {
                check(e.code == PagedKVException.POOL_EXHAUSTED && e.getMessage().contains("exhausted"),
                      "exhaustion throws PoolExhaustedException: " + e.getMessage());
            }
            check(r.grow(s0.totalBlocks) == s0.totalBlocks, "grow restores the pool");
            try {
                r.generate(conv, promptIds, 2, 0f, 0, 1f, 0, (id, piece) -> {
                    throw new IllegalStateException("from the listener");
                });
                check(false, "listener exception propagates");
            } catch (IllegalStateException e) {
                check(true, "listener exception propagates to the caller");
            }
            try {
                r.clear(12345);
                check(false, "unknown conversation throws");
            } catch (PagedKVException e) {
                check(e.code == PagedKVException.STATE, "unknown conversation -> PagedKVException(STATE)");
            }
            check("h\u00e9llo \u4e2d \uD83D\uDE00".equals(r.decode(r.encode("h\u00e9llo \u4e2d \uD83D\uDE00"))),
                  "non-ASCII round trip through the bridge");
        }
        try {
            new NativeRunner(fix + "/missing", 0, 0);
            check(false, "missing artifacts throw");
        } catch (PagedKVException e) {
            check(e.code == PagedKVException.ARTIFACT, "missing artifacts -> PagedKVException(ARTIFACT)");
        }
        NativeRunner closed = new NativeRunner(art, 0, 0);
        closed.close();
        try {
            closed.stats();
            check(false, "closed runner throws");
        } catch (PagedKVException e) {
            check(true, "a closed runner throws instead of crashing");
        }
        System.out.println(passed + " passed, " + failed + " failed");
        System.exit(failed == 0 ? 0 : 1);
    }
}
