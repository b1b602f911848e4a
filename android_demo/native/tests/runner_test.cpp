// Runner tests on a tiny exported model (fixtures made by tests/make_fixtures.py):
//   runner_test FIXTURES_DIR [--expect-isa NAME] [--no-rss] [--tokens-out FILE] [--only TEST,TEST...]
// FIXTURES_DIR holds artifacts/ (model.pte, pagedkv.json, tokenizer.json) and expected.json (HF's
// greedy tokens for each prompt, fp32 pool).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "json.h"
#include "runner.h"
#include "test_util.h"

using namespace pagedkv_rt;

namespace {

std::string g_fix, g_art, g_expect_isa, g_tokens_out;
bool g_rss = true;

struct Case {
  std::string prompt;
  std::vector<int32_t> prompt_ids, hf;
};
std::vector<Case> g_cases;

std::vector<int32_t> ints(const Json& a) {
  std::vector<int32_t> v;
  for (const Json& x : a.items()) v.push_back(static_cast<int32_t>(x.as_int()));
  return v;
}

long rss_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

ErrorCode code_of(const std::function<void()>& f, std::string* msg = nullptr) {
  try {
    f();
  } catch (const RunnerError& e) {
    if (msg) *msg = e.what();
    return e.code();
  }
  return static_cast<ErrorCode>(0);
}

RunnerConfig cfg(int64_t budget = 0) {
  RunnerConfig c;
  c.artifacts_dir = g_art;
  c.pool_budget_bytes = budget;
  return c;
}

std::vector<int32_t> greedy(Runner& r, int conv, const Case& c, std::string* text = nullptr) {
  return r.generate(conv, c.prompt_ids, static_cast<int>(c.hf.size()), Sampling{},
                    [&](int32_t, const std::string& piece) {
                      if (text) *text += piece;
                      return true;
                    });
}

std::string show(const std::vector<int32_t>& v) {
  std::ostringstream s;
  for (size_t i = 0; i < v.size(); ++i) s << (i ? " " : "") << v[i];
  return s.str();
}

}  // namespace

// runner_test --requantize SRC DST HEAD_DIM N IN OUT: requantize_records on N records read from IN (their
// codes, then their float16 scales, raw) written to OUT the same way; SRC and DST are
// "k_bits,v_bits,k_group,v_group,k_sym,v_sym". tests/test_runner_compact.py compares OUT with
// toolkit.quant.requantize.
static int requantize_tool(char** argv) {
  auto bits = [](const char* s) {
    RecordBits b;
    int ks = 0, vs = 0;
    if (std::sscanf(s, "%d,%d,%d,%d,%d,%d", &b.k_bits, &b.v_bits, &b.k_group, &b.v_group, &ks, &vs) != 6) std::exit(2);
    b.k_sym = ks != 0, b.v_sym = vs != 0;
    return b;
  };
  const RecordBits src = bits(argv[2]), dst = bits(argv[3]);
  const int d = std::atoi(argv[4]);
  const size_t n = static_cast<size_t>(std::atol(argv[5]));
  int scw, ssw, dcw, dsw;
  record_widths(src, d, &scw, &ssw);
  record_widths(dst, d, &dcw, &dsw);
  std::ifstream in(argv[6], std::ios::binary);
  std::vector<uint8_t> codes(n * static_cast<size_t>(scw)), oc(n * static_cast<size_t>(dcw));
  std::vector<uint16_t> scales(n * static_cast<size_t>(ssw)), os(n * static_cast<size_t>(dsw));
  in.read(reinterpret_cast<char*>(codes.data()), static_cast<std::streamsize>(codes.size()));
  in.read(reinterpret_cast<char*>(scales.data()), static_cast<std::streamsize>(scales.size() * 2));
  if (!in) return 2;
  requantize_records(codes.data(), scales.data(), n, src, dst, d, oc.data(), os.data());
  std::ofstream out(argv[7], std::ios::binary);
  out.write(reinterpret_cast<const char*>(oc.data()), static_cast<std::streamsize>(oc.size()));
  out.write(reinterpret_cast<const char*>(os.data()), static_cast<std::streamsize>(os.size() * 2));
  return out ? 0 : 2;
}


// runner_test --ladder ARTIFACTS SCRIPT OUT: a Runner driven by a script of calls, for tests comparing it
// with runtime_sim's engine (tests/test_runner_ladder.py). SCRIPT (JSON): {"policy", "horizon", "spill_dir",
// "threads", "steps": [{"op": "new"} | {"op": "generate", "conv", "ids", "decode"} | {"op": "save", "conv",
// "path"} | {"op": "restore", "path"} | {"op": "compact", "conv", "horizon"} | {"op": "close", "conv"}]}. OUT
// (JSON): per step its result ("tokens" / "conv" / "bytes" / "moved", or "error" and "code" of the
// RunnerError it threw) and the pool after it ("ladder" counters, "used", "free", "free_compact",
// "sequences", "kinds": each conversation's global blocks 0 hole / 1 default / 2 compact, [] if spilled).
// The pool's invariants are checked after every step (a broken one: exit 1).
static std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (unsigned char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\', o += static_cast<char>(ch);
    else if (ch < 0x20) o += ' ';
    else o += static_cast<char>(ch);
  }
  return o + "\"";
}

static int ladder_tool(char** argv) {
  std::ifstream f(argv[3]);
  std::stringstream ss;
  ss << f.rdbuf();
  const Json script = Json::parse(ss.str());
  RunnerConfig c;
  c.artifacts_dir = argv[2];
  c.policy = script["policy"].as_string();
  c.compact_horizon = static_cast<int>(script["horizon"].as_int());
  if (const Json* d = script.find("spill_dir")) c.spill_dir = d->as_string();
  if (const Json* t = script.find("threads")) c.num_threads = static_cast<int>(t->as_int());
  Runner r(c);
  std::vector<int> convs;
  std::string out = "{\"steps\": [";
  size_t k = 0;
  for (const Json& st : script["steps"].items()) {
    const std::string op = st["op"].as_string();
    std::string res;
    try {
      if (op == "new") {
        convs.push_back(r.new_conversation());
        res = "\"conv\": " + std::to_string(convs.back());
      } else if (op == "generate") {
        Sampling greedy;
        greedy.ignore_stop = true;
        const auto toks = r.generate(static_cast<int>(st["conv"].as_int()), ints(st["ids"]),
                                     static_cast<int>(st["decode"].as_int()), greedy, nullptr);
        res = "\"tokens\": [";
        for (size_t i = 0; i < toks.size(); ++i) res += (i ? "," : "") + std::to_string(toks[i]);
        res += "]";
      } else if (op == "save") {
        res = "\"bytes\": " + std::to_string(r.save(static_cast<int>(st["conv"].as_int()), st["path"].as_string()));
      } else if (op == "restore") {
        convs.push_back(r.restore(st["path"].as_string()));
        res = "\"conv\": " + std::to_string(convs.back());
      } else if (op == "compact") {
        const auto moved = r.compact(static_cast<int>(st["conv"].as_int()), static_cast<int>(st["horizon"].as_int()));
        res = "\"moved\": [";
        for (size_t i = 0; i < moved.size(); ++i) res += (i ? "," : "") + std::to_string(std::get<0>(moved[i]));
        res += "]";
      } else if (op == "shrink") {  // onTrimMemory: Runner::shrink, then the pool's committed bytes
        const ShrinkResult sr = r.shrink(static_cast<int>(st["target"].as_int()));
        res = "\"usable_before\": " + std::to_string(sr.usable_before) + ", \"usable_after\": " +
              std::to_string(sr.usable_after) + ", \"moved_blocks\": " + std::to_string(sr.moved_blocks) +
              ", \"blocked_by_used\": " + std::to_string(sr.blocked_by_used) + ", \"released_bytes\": " +
              std::to_string(sr.released_bytes) + ", \"committed_bytes\": " + std::to_string(r.stats().committed_bytes);
      } else if (op == "grow") {
        res = "\"usable\": " + std::to_string(r.grow(static_cast<int>(st["target"].as_int())));
      } else if (op == "close") {
        const int id = static_cast<int>(st["conv"].as_int());
        r.close(id);
        convs.erase(std::find(convs.begin(), convs.end(), id));
        res = "\"closed\": " + std::to_string(id);
      } else {
        std::fprintf(stderr, "unknown op %s\n", op.c_str());
        return 2;
      }
    } catch (const RunnerError& e) {
      res = "\"error\": " + json_str(e.what()) + ", \"code\": " + std::to_string(static_cast<int>(e.code()));
    }
    try {
      r.check_invariants();
    } catch (const RunnerError& e) {
      std::fprintf(stderr, "invariant broken after step %zu (%s): %s\n", k, op.c_str(), e.what());
      return 1;
    }
    const PoolStats p = r.stats();
    const LadderStats& l = p.ladder;
    out += std::string(k++ ? ", " : "") + "{\"op\": \"" + op + "\", " + res + ", \"ladder\": {\"slides\": " +
           std::to_string(l.slides) + ", \"spills\": " + std::to_string(l.spills) + ", \"spill_bytes\": " +
           std::to_string(l.spill_bytes) + ", \"spill_failures\": " + std::to_string(l.spill_failures) +
           ", \"restores_from_spill\": " + std::to_string(l.restores_from_spill) + ", \"spill_reprefills\": " +
           std::to_string(l.spill_reprefills) + ", \"spilled_now\": " + std::to_string(l.spilled_now) +
           ", \"compactions\": " + std::to_string(l.compactions) + ", \"compacted_blocks\": " +
           std::to_string(l.compacted_blocks) + ", \"compact_blocks_in_use\": " + std::to_string(l.compact_blocks_in_use) +
           "}, \"used\": " + std::to_string(p.used_blocks) + ", \"free\": " + std::to_string(p.free_blocks) +
           ", \"free_compact\": " + std::to_string(p.compact_blocks - l.compact_blocks_in_use) + ", \"sequences\": " +
           std::to_string(p.sequences) + ", \"kinds\": {";
    for (size_t i = 0; i < convs.size(); ++i) {
      const auto kinds = r.block_kinds(convs[i]);
      out += (i ? ", " : "") + std::string("\"") + std::to_string(convs[i]) + "\": [";
      for (size_t j = 0; j < kinds.size(); ++j) out += (j ? "," : "") + std::to_string(kinds[j]);
      out += "]";
    }
    out += "}}";
  }
  out += "]}\n";
  std::ofstream o(argv[4]);
  o << out;
  return o ? 0 : 2;
}

int main(int argc, char** argv) {
  if (argc == 8 && std::string(argv[1]) == "--requantize") return requantize_tool(argv);
  if (argc == 5 && std::string(argv[1]) == "--ladder") return ladder_tool(argv);
  if (argc < 2) {
    std::fprintf(stderr, "usage: runner_test FIXTURES_DIR [--expect-isa NAME] [--no-rss] [--tokens-out FILE] "
                 "[--only TEST,TEST...]\n");
    return 2;
  }
  g_fix = argv[1];
  g_art = g_fix + "/artifacts";
  t::Summary s;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--only" && i + 1 < argc) {
      std::stringstream names(argv[++i]);
      for (std::string n; std::getline(names, n, ',');) s.only.push_back(n);
    } else if (a == "--expect-isa" && i + 1 < argc) g_expect_isa = argv[++i];
    else if (a == "--no-rss") g_rss = false;
    else if (a == "--tokens-out" && i + 1 < argc) g_tokens_out = argv[++i];
  }
  {
    std::ifstream f(g_fix + "/expected.json");
    std::stringstream ss;
    ss << f.rdbuf();
    Json e = Json::parse(ss.str());
    for (const Json& c : e["cases"].items())
      g_cases.push_back({c["prompt"].as_string(), ints(c["prompt_ids"]), ints(c["hf_greedy"])});
  }
  std::vector<std::vector<int32_t>> runner_tokens;

  s.run("preallocates_every_arena", [] {
    Runner r(cfg());
    PoolStats st = r.stats();
    std::printf("    pool: %d blocks x %d tokens, %d allocations, largest %lld bytes, committed %lld bytes, isa %s\n",
                st.total_blocks, st.block_size, st.num_allocations, (long long)st.largest_allocation_bytes,
                (long long)st.committed_bytes, st.isa.c_str());
    CHECK_EQ(st.usable_blocks, st.total_blocks);
    CHECK_EQ(st.free_blocks, st.total_blocks);
    CHECK_EQ(st.used_blocks, 0);
    CHECK(st.num_allocations >= 3);  // activations + one per layer
    CHECK(st.largest_allocation_bytes < st.reserved_bytes);
    CHECK(st.committed_bytes == st.reserved_bytes);
    if (!g_expect_isa.empty()) {
      if (st.isa != g_expect_isa) std::printf("    isa %s, expected %s\n", st.isa.c_str(), g_expect_isa.c_str());
      CHECK(st.isa == g_expect_isa);
    }
    CHECK(st.threads >= 1);
  });

  s.run("num_threads_sizes_the_one_threadpool", [] {
    RunnerConfig c = cfg();
    c.num_threads = 1;
    CHECK_EQ(Runner(c).stats().threads, 1);
    c.num_threads = 2;
    CHECK_EQ(Runner(c).stats().threads, 2);
  });

  s.run("tokenizer_matches_hf_ids", [] {
    Runner r(cfg());
    for (const Case& c : g_cases) CHECK(r.tokenizer().encode(c.prompt) == c.prompt_ids);
  });

  s.run("greedy_tokens_equal_hf", [&] {
    Runner r(cfg());
    for (const Case& c : g_cases) {
      int conv = r.new_conversation();
      std::string text;
      auto got = greedy(r, conv, c, &text);
      runner_tokens.push_back(got);
      if (got != c.hf) std::printf("    runner: %s\n    hf:     %s\n", show(got).c_str(), show(c.hf).c_str());
      CHECK(got == c.hf);
      CHECK(text == r.tokenizer().decode(got, true));  // streamed pieces add up to the decoded text
      r.check_invariants();
    }
    PoolStats st = r.stats();
    CHECK_EQ(st.sequences, static_cast<int>(g_cases.size()));
    CHECK(st.decode_tok_s > 0 && st.prefill_tok_s > 0);
    std::printf("    prefill %.0f tok/s, decode %.0f tok/s\n", st.prefill_tok_s, st.decode_tok_s);
  });

  s.run("clear_releases_blocks", [] {
    Runner r(cfg());
    int a = r.new_conversation(), b = r.new_conversation();
    CHECK(greedy(r, a, g_cases[0]) == g_cases[0].hf);
    int used_a = r.stats().used_blocks;
    CHECK(greedy(r, b, g_cases[1]) == g_cases[1].hf);  // b beside a: separate block tables
    int used_ab = r.stats().used_blocks;
    CHECK(used_ab > used_a);
    r.clear(a);
    CHECK_EQ(r.stats().used_blocks, used_ab - used_a);
    CHECK_EQ(r.conversation_length(a), 0);
    r.clear(b);
    CHECK_EQ(r.stats().used_blocks, 0);
    CHECK_EQ(r.stats().kv_bytes_in_use, 0);
    CHECK(greedy(r, a, g_cases[0]) == g_cases[0].hf);  // the cleared conversation starts fresh
    r.close(a);
    r.close(b);
    CHECK_EQ(r.stats().used_blocks, 0);
    CHECK(code_of([&] { r.clear(a); }) == ErrorCode::kState);
    r.check_invariants();
  });

  s.run("shrink_releases_free_part", [] {
    Runner r(cfg());
    int a = r.new_conversation();
    CHECK(greedy(r, a, g_cases[0]) == g_cases[0].hf);
    PoolStats before = r.stats();
    long rss0 = rss_kib();
    ShrinkResult sr = r.shrink(0);
    long rss1 = rss_kib();
    PoolStats after = r.stats();
    std::printf("    shrink(0): usable %d -> %d, %d used block(s) kept it up, released %lld bytes, RSS %ld -> %ld KiB\n",
                sr.usable_before, sr.usable_after, sr.blocked_by_used, (long long)sr.released_bytes, rss0, rss1);
    CHECK_EQ(sr.usable_after, before.used_blocks);  // lowest ids first: used blocks are 0..n-1
    CHECK_EQ(sr.blocked_by_used, before.used_blocks);
    CHECK_EQ(after.free_blocks, 0);
    CHECK(sr.released_bytes > 0);
    CHECK(after.committed_bytes < before.committed_bytes);
    if (g_rss) CHECK(rss0 - rss1 >= sr.released_bytes / 1024 / 2);
    // the conversation can still run inside its blocks, and exhaustion is an error, not a crash
    std::string msg;
    CHECK(code_of([&] { r.generate(a, std::vector<int32_t>(40, 5), 1, Sampling{}, nullptr); }, &msg) ==
          ErrorCode::kPoolExhausted);
    CHECK(msg.find("exhausted") != std::string::npos);
    r.clear(a);
    ShrinkResult sr2 = r.shrink(1);
    CHECK_EQ(sr2.usable_after, 1);
    CHECK_EQ(r.grow(before.usable_blocks), before.usable_blocks);
    CHECK_EQ(r.stats().free_blocks, before.usable_blocks);
    CHECK(greedy(r, a, g_cases[1]) == g_cases[1].hf);  // released pages come back zeroed and are rewritten
    r.check_invariants();
  });

  s.run("budget_sizes_pool_and_exhaustion_is_an_error", [] {
    const PoolStats full = Runner(cfg()).stats();
    Runner r(cfg(full.pool_fixed_bytes + full.bytes_per_block * 3));  // room for 3 blocks = 48 tokens
    PoolStats st = r.stats();
    CHECK_EQ(st.usable_blocks, 3);
    CHECK(st.committed_bytes < st.reserved_bytes);
    int a = r.new_conversation();
    const Case& c = g_cases[0];  // prompt (39 tokens) + 24 new tokens > 48
    std::vector<int32_t> streamed;
    std::string msg;
    ErrorCode code = code_of(
        [&] {
          r.generate(a, c.prompt_ids, static_cast<int>(c.hf.size()), Sampling{}, [&](int32_t id, const std::string&) {
            streamed.push_back(id);
            return true;
          });
        },
        &msg);
    std::printf("    %s\n", msg.c_str());
    CHECK(code == ErrorCode::kPoolExhausted);
    CHECK(!streamed.empty());
    CHECK(std::equal(streamed.begin(), streamed.end(), c.hf.begin()));  // what came out was right
    CHECK_EQ(r.stats().used_blocks, 3);
    // a prompt that cannot fit is refused up front, nothing changes
    int b = r.new_conversation();
    CHECK(code_of([&] { r.generate(b, std::vector<int32_t>(40, 5), 4, Sampling{}, nullptr); }) ==
          ErrorCode::kPoolExhausted);
    CHECK_EQ(r.conversation_length(b), 0);
    r.clear(a);
    CHECK_EQ(r.stats().used_blocks, 0);
    CHECK(r.generate(b, c.prompt_ids, 3, Sampling{}, nullptr) ==
          std::vector<int32_t>(c.hf.begin(), c.hf.begin() + 3));
    r.check_invariants();
  });

  s.run("clean_errors", [] {
    std::string msg;
    CHECK(code_of([] { Runner r(cfg(1000)); }, &msg) == ErrorCode::kArgument);
    CHECK(msg.find("too small") != std::string::npos);
    RunnerConfig bad = cfg();
    bad.fail_allocation_at = 1;
    CHECK(code_of([&] { Runner r(bad); }, &msg) == ErrorCode::kAllocation);
    std::printf("    %s\n", msg.c_str());
    RunnerConfig missing = cfg();
    missing.artifacts_dir = g_fix + "/no-such-dir";
    CHECK(code_of([&] { Runner r(missing); }, &msg) == ErrorCode::kArtifact);
    // a manifest or tokenizer config cut short: kArtifact naming the file
    namespace fs = std::filesystem;
    const fs::path copy = fs::temp_directory_path() / ("runner_test_json_" + std::to_string(getpid()));
    for (const char* name : {"pagedkv.json", "tokenizer_config.json"}) {
      fs::remove_all(copy);
      fs::copy(g_art, copy, fs::copy_options::recursive);
      CHECK(fs::exists(copy / name));
      std::ofstream(copy / name, std::ios::trunc) << "{\"format_version\": 1,";
      RunnerConfig cut = cfg();
      cut.artifacts_dir = copy.string();
      CHECK(code_of([&] { Runner r(cut); }, &msg) == ErrorCode::kArtifact);
      CHECK(msg.find(name) != std::string::npos && msg.find("not valid JSON") != std::string::npos);
    }
    fs::remove_all(copy);
    Runner r(cfg());  // still fine after the failures
    int a = r.new_conversation();
    CHECK(code_of([&] { r.generate(a, {}, 4, Sampling{}, nullptr); }) == ErrorCode::kArgument);
    CHECK(code_of([&] { r.generate(a, {1 << 30}, 4, Sampling{}, nullptr); }) == ErrorCode::kArgument);
    CHECK(code_of([&] { r.generate(99, {5}, 4, Sampling{}, nullptr); }) == ErrorCode::kState);
    CHECK(code_of([&] { for (int i = 0; i < 64; ++i) r.new_conversation(); }) == ErrorCode::kState);
  });

  s.run("sampling_is_seeded", [] {
    Runner r(cfg());
    Sampling sp;
    sp.temperature = 0.8f;
    sp.top_k = 40;
    sp.top_p = 0.95f;
    sp.seed = 7;
    int a = r.new_conversation(), b = r.new_conversation();
    auto x = r.generate(a, g_cases[0].prompt_ids, 12, sp, nullptr);
    auto y = r.generate(b, g_cases[0].prompt_ids, 12, sp, nullptr);
    CHECK(x == y);
    for (int32_t id : x) CHECK(id >= 0 && id < r.tokenizer().vocab_size());
  });

  // Runner::save / restore (toolkit/CONVERSATION_FORMAT.md): a bad file or no free slot is one error and
  // changes nothing; a good file restored beside the saved conversation continues exactly as it does.
  s.run("save_restore_keeps_the_pool_on_bad_files", [] {
    Runner r(cfg());
    const Case& c = g_cases[0];
    const int a = r.new_conversation();
    r.generate(a, c.prompt_ids, 4, Sampling{}, nullptr);
    const std::string path = "/tmp/pagedkv_runner_test_" + std::to_string(getpid()) + ".pkvc";
    const std::string bad = path + ".bad";
    CHECK(r.save(a, path) > 0);
    std::string bytes;
    {
      std::ifstream f(path, std::ios::binary);
      std::stringstream ss;
      ss << f.rdbuf();
      bytes = ss.str();
    }
    std::ofstream(bad, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
    const PoolStats before = r.stats();
    std::string msg;
    CHECK(code_of([&] { r.restore(bad); }, &msg) == ErrorCode::kArgument);
    CHECK(msg.find("checksum mismatch") != std::string::npos);
    CHECK(code_of([&] { r.restore(path + ".missing"); }) == ErrorCode::kArgument);
    CHECK(r.stats().used_blocks == before.used_blocks && r.stats().sequences == before.sequences);
    r.check_invariants();
    const int b = r.restore(path);  // beside `a` (the fixture has 2 slots), no prefill
    CHECK(r.conversation_tokens(b) == r.conversation_tokens(a));
    CHECK(r.stats().prefill_tokens == before.prefill_tokens);
    CHECK(r.stats().used_blocks == 2 * before.used_blocks);
    const PoolStats full = r.stats();  // every slot in use: a third restore is refused, nothing changed
    CHECK(code_of([&] { r.restore(path); }, &msg) == ErrorCode::kState);
    CHECK(msg.find("slots are in use") != std::string::npos);
    CHECK(r.stats().used_blocks == full.used_blocks && r.stats().sequences == full.sequences);
    r.check_invariants();
    const std::vector<int32_t> more(c.prompt_ids.begin(), c.prompt_ids.begin() + 3);
    CHECK(r.generate(a, more, 6, Sampling{}, nullptr) == r.generate(b, more, 6, Sampling{}, nullptr));
    unlink(path.c_str());
    unlink(bad.c_str());
  });

  if (!g_tokens_out.empty()) {
    std::ofstream f(g_tokens_out);
    for (const auto& v : runner_tokens) f << show(v) << "\n";
  }
  return s.finish();
}
