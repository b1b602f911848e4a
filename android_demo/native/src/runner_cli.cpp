// pagedkv-runner: the app's Runner (runner.h) driven from the command line, for measuring what a
// phone would see: one conversation, a prompt of exactly --ctx tokens, --decode greedy tokens.
//
//   pagedkv-runner ARTIFACTS --prompt-file F --ctx N --decode N [--threads N] [--budget-mb M] [--json]
//                  [--restore FILE] [--save FILE]
//
// ARTIFACTS is a dir made by `pagedkv export --format pte`. The prompt is the first N tokens of F
// (encoded by the runner's tokenizer, no special tokens). Prints prefill tok/s, time to first token,
// decode tok/s, the process's peak resident set (VmHWM) and a breakdown of the resident set after the
// run: the .pte's mapped pages (weights read from the file), the KV pool arenas, the activation arena,
// shared libraries, and the rest (heap: XNNPACK's packed weights, the runtime's own allocations).
// A model with sliding-window layers (the manifest's "groups") reports each layer group's blocks too
// (--json: "groups": [{window, layers, total/usable/used/free/peak_used blocks, bytes_per_block}]).
// --restore FILE: before the prompt, the conversation is restored from FILE (a conversation file,
// toolkit/CONVERSATION_FORMAT.md: Engine.save or --save), without prefill; its tokens must be the first
// ones of the prompt, and only the rest of the prompt is fed. --save FILE: after the run, the
// conversation (its blocks, tokens and pending token) is written to FILE (--json: "saved_bytes").
// --policy auto|error|sliding|adaptive (default auto: adaptive for a .pte with a compact region, else
// error): what happens when a call needs blocks that are not free (RunnerConfig::policy; the pool must
// then hold --ctx + --decode only with policy error);
// --compact-horizon N: adaptive's compact rung moves blocks ending >= N tokens back (default 1024);
// --spill-dir DIR: adaptive's spill rung writes idle conversations there (one conversation here: never
// taken, kept for the app's runner). --json reports "ladder" (the rungs taken, runtime_sim's
// Engine.stats()["ladder"] names) and "block_kinds" (the conversation's global blocks: 0 hole, 1 default,
// 2 compact).
// Bad input: one line on stderr naming the problem and the fix, exit 2.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits.h>
#include <sstream>
#include <string>
#include <vector>

#include "runner.h"

using namespace pagedkv_rt;

namespace {

[[noreturn]] void fail(const std::string& msg, int code = 2) {
  std::fprintf(stderr, "pagedkv-runner: %s\n", msg.c_str());
  std::exit(code);
}

const char* kUsage =
    "usage: pagedkv-runner ARTIFACTS --prompt-file F --ctx N --decode N [--threads N] [--budget-mb M] "
    "[--prefill-chunk N] "
    "[--isa NAME] [--json] [--restore FILE] [--save FILE] [--policy auto|error|sliding|adaptive] [--compact-horizon N] "
    "[--spill-dir DIR]";

int64_t parse_int(const std::string& flag, const char* v, int64_t lo) {
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 10);
  if (!*v || *end || x < lo)
    fail(flag + " " + v + " is not an integer >= " + std::to_string(lo) + ": " + kUsage);
  return x;
}

// kB fields of /proc/self/status (VmHWM, VmRSS), in bytes
int64_t status_bytes(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(key.size())) * 1024;
  return -1;
}

// Resident bytes of file mappings (/proc/self/smaps): the one file `path`, and all shared libraries.
void mapped_resident(const std::string& path, int64_t* file_rss, int64_t* libs_rss) {
  std::ifstream f("/proc/self/smaps");
  std::string line, current;
  *file_rss = *libs_rss = 0;
  while (std::getline(f, line)) {
    if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') < 17) {
      // header: addr perms offset dev inode [path]
      std::istringstream ss(line);
      std::string a, p, o, d, ino;
      ss >> a >> p >> o >> d >> ino;
      std::getline(ss, current);
      current.erase(0, current.find_first_not_of(' '));
    } else if (line.rfind("Rss:", 0) == 0) {
      int64_t kb = std::stoll(line.substr(4)) * 1024;
      if (current == path) *file_rss += kb;
      else if (current.find(".so") != std::string::npos) *libs_rss += kb;
    }
  }
}

std::string real_path(const std::string& p) {
  char buf[PATH_MAX];
  return realpath(p.c_str(), buf) ? std::string(buf) : p;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::string art, prompt_file, isa, save_path, restore_path, policy = "auto", spill_dir;
  int64_t ctx = -1, decode = -1, threads = 0, budget_mb = 0, horizon = 1024;
  bool json = false;
  int64_t prefill_chunk = 0;  // tokens per prefill call (RunnerConfig::prefill_chunk; 0: the .pte's maximum)
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) fail(a + " needs a value: " + kUsage);
      return argv[++i];
    };
    if (a == "--prompt-file") prompt_file = value();
    else if (a == "--ctx") ctx = parse_int(a, value(), 1);
    else if (a == "--decode") decode = parse_int(a, value(), 1);
    else if (a == "--threads") threads = parse_int(a, value(), 0);
    else if (a == "--budget-mb") budget_mb = parse_int(a, value(), 0);
    else if (a == "--prefill-chunk") prefill_chunk = parse_int(a, value(), 1);
    else if (a == "--isa") isa = value();
    else if (a == "--json") json = true;
    else if (a == "--save") save_path = value();
    else if (a == "--restore") restore_path = value();
    else if (a == "--policy") policy = value();
    else if (a == "--compact-horizon") horizon = parse_int(a, value(), 1);
    else if (a == "--spill-dir") spill_dir = value();
    else if (a == "-h" || a == "--help") { std::printf("%s\n", kUsage); return 0; }
    else if (!a.empty() && a[0] == '-') fail("unknown option " + a + ": " + kUsage);
    else if (art.empty()) art = a;
    else fail("unexpected argument " + a + ": " + kUsage);
  }
  if (art.empty() || prompt_file.empty() || ctx < 0 || decode < 0)
    fail("ARTIFACTS, --prompt-file, --ctx and --decode are required: " + std::string(kUsage));
  std::string text;
  {
    std::ifstream f(prompt_file, std::ios::binary);
    if (!f) fail("prompt file " + prompt_file + " not found: pass a text file with --prompt-file");
    std::ostringstream ss;
    ss << f.rdbuf();
    text = ss.str();
  }
  try {
    RunnerConfig cfg;
    cfg.artifacts_dir = art;
    cfg.pool_budget_bytes = budget_mb << 20;
    cfg.num_threads = static_cast<int>(threads);
    cfg.prefill_chunk = static_cast<int>(prefill_chunk);
    cfg.isa = isa;
    cfg.policy = policy;
    cfg.compact_horizon = static_cast<int>(std::min<int64_t>(horizon, 1 << 30));
    cfg.spill_dir = spill_dir;
    const double t_load = now_s();
    Runner r(cfg);
    const double load_s = now_s() - t_load;
    // the first ctx tokens of the text: encode a prefix long enough (doubling), not the whole file
    std::vector<int32_t> ids;
    for (size_t chars = static_cast<size_t>(ctx) * 8;; chars *= 2) {
      ids = r.tokenizer().encode(text.substr(0, chars), false);
      if (static_cast<int64_t>(ids.size()) > ctx || chars >= text.size()) break;
    }
    if (static_cast<int64_t>(ids.size()) < ctx)
      fail(prompt_file + " has " + std::to_string(ids.size()) + " tokens, fewer than --ctx " + std::to_string(ctx) +
           ": give a longer text or a smaller --ctx");
    ids.resize(static_cast<size_t>(ctx));

    // a pool whose group 0 is global must hold every token; a model with only sliding layers holds a
    // window per conversation whatever the length (its pool was sized for that at export)
    if (const PoolStats s0 = r.stats(); s0.ladder.policy == "error" && (s0.groups.empty() || s0.groups[0].window == 0)) {
      const int64_t room = static_cast<int64_t>(s0.usable_blocks) * s0.block_size;
      if (ctx + decode > room)
        fail("--ctx " + std::to_string(ctx) + " + --decode " + std::to_string(decode) + " tokens do not fit the pool: " +
             std::to_string(s0.usable_blocks) + " usable blocks of " + std::to_string(s0.block_size) + " tokens (" +
             std::to_string(room) + " tokens" + (budget_mb ? " under --budget-mb " + std::to_string(budget_mb) : "") +
             "); raise --budget-mb, lower --ctx/--decode, or export a larger pool (--pool-tokens)");
    }
    int conv;
    size_t restored = 0;  // tokens the restored conversation holds (cache + pending)
    if (!restore_path.empty()) {
      conv = r.restore(restore_path);
      const std::vector<int32_t> held = r.conversation_tokens(conv);
      if (held.size() >= ids.size() || !std::equal(held.begin(), held.end(), ids.begin()))
        fail(restore_path + " holds " + std::to_string(held.size()) + " tokens that are not the start of the " +
             std::to_string(ids.size()) + "-token prompt: give the prompt it was saved from with a larger --ctx");
      restored = held.size();
      ids.erase(ids.begin(), ids.begin() + static_cast<long>(restored));
    } else {
      conv = r.new_conversation();
    }
    Sampling greedy;
    greedy.ignore_stop = true;  // a fixed number of steps, like the peers' benchmarks
    double t0 = now_s(), ttft = -1;
    std::vector<int32_t> out = r.generate(conv, ids, static_cast<int>(decode), greedy, [&](int32_t, const std::string&) {
      if (ttft < 0) ttft = now_s() - t0;
      return true;
    });
    const double total_s = now_s() - t0;
    r.check_invariants();
    const std::vector<uint8_t> kinds = r.block_kinds(conv);
    const int64_t saved_bytes = save_path.empty() ? 0 : r.save(conv, save_path);
    PoolStats st = r.stats();
    MemoryUse mu = r.memory_use();
    int64_t weights_file = 0, libs = 0;
    mapped_resident(real_path(mu.program_path), &weights_file, &libs);
    const int64_t hwm = status_bytes("VmHWM"), rss = status_bytes("VmRSS");
    const int64_t rest = rss - weights_file - mu.pool_resident - mu.activations_resident - libs;
    if (json) {
      std::printf(
          "{\"ctx\": %lld, \"decode\": %zu, \"threads\": %d, \"isa\": \"%s\", \"load_s\": %.4f, \"ttft_s\": %.4f, "
          "\"prefill_tok_s\": %.3f, \"decode_tok_s\": %.3f, \"total_s\": %.4f, \"peak_rss_bytes\": %lld, "
          "\"rss_bytes\": %lld, \"weights_file_resident_bytes\": %lld, \"kv_pool_resident_bytes\": %lld, "
          "\"kv_pool_reserved_bytes\": %lld, \"kv_bytes\": %lld, \"activations_resident_bytes\": %lld, "
          "\"activations_reserved_bytes\": %lld, \"libraries_resident_bytes\": %lld, \"rest_bytes\": %lld, "
          "\"pool_blocks\": %d, \"usable_blocks\": %d, \"used_blocks\": %d, \"pool_fixed_bytes\": %lld, ",
          (long long)ctx, out.size(), st.threads, st.isa.c_str(), load_s, ttft, st.prefill_tok_s, st.decode_tok_s,
          total_s, (long long)hwm, (long long)rss, (long long)weights_file, (long long)mu.pool_resident,
          (long long)mu.pool_reserved, (long long)st.kv_bytes_in_use, (long long)mu.activations_resident,
          (long long)mu.activations_reserved, (long long)libs, (long long)rest, st.total_blocks, st.usable_blocks,
          st.used_blocks, (long long)st.pool_fixed_bytes);
      // the compact region (a .pte exported with --compact-blocks N): its blocks and bytes, 0 without one
      std::printf("\"compact_blocks\": %d, \"compact_bytes\": %lld, ", st.compact_blocks, (long long)st.compact_bytes);
      if (!st.groups.empty()) {  // per layer group (models with sliding layers): block counts of each pool
        std::printf("\"groups\": [");
        for (size_t g = 0; g < st.groups.size(); ++g) {
          const GroupStats& x = st.groups[g];
          std::printf("%s{\"window\": %d, \"layers\": %d, \"total_blocks\": %d, \"usable_blocks\": %d, "
                      "\"used_blocks\": %d, \"free_blocks\": %d, \"peak_used_blocks\": %d, \"bytes_per_block\": %lld}",
                      g ? ", " : "", x.window, x.layers, x.total_blocks, x.usable_blocks, x.used_blocks, x.free_blocks,
                      x.peak_used_blocks, (long long)x.bytes_per_block);
        }
        std::printf("], ");
      }
      const LadderStats& l = st.ladder;  // the pressure ladder's rungs taken
      std::printf("\"ladder\": {\"policy\": \"%s\", \"slides\": %lld, \"spills\": %lld, \"spill_bytes\": %lld, "
                  "\"spill_failures\": %lld, \"restores_from_spill\": %lld, \"spill_reprefills\": %lld, "
                  "\"spilled_now\": %d, \"compactions\": %lld, \"compacted_blocks\": %lld, "
                  "\"compact_blocks_in_use\": %d}, \"block_kinds\": [",
                  l.policy.c_str(), (long long)l.slides, (long long)l.spills, (long long)l.spill_bytes,
                  (long long)l.spill_failures, (long long)l.restores_from_spill, (long long)l.spill_reprefills,
                  l.spilled_now, (long long)l.compactions, (long long)l.compacted_blocks, l.compact_blocks_in_use);
      for (size_t i = 0; i < kinds.size(); ++i) std::printf("%s%d", i ? ", " : "", kinds[i]);
      std::printf("], ");
      if (!restore_path.empty()) std::printf("\"restored_tokens\": %zu, ", restored);
      if (!save_path.empty()) std::printf("\"saved_bytes\": %lld, ", (long long)saved_bytes);
      std::printf("\"generated\": [");
      for (size_t i = 0; i < out.size(); ++i) std::printf("%s%d", i ? ", " : "", out[i]);
      std::printf("]}\n");
    } else {
      const double M = 1 << 20;
      std::printf("pagedkv-runner: %s, ctx %lld, %zu tokens generated, %d threads, kernel path %s\n", art.c_str(),
                  (long long)ctx, out.size(), st.threads, st.isa.c_str());
      std::printf("  load             %8.2f s\n", load_s);
      std::printf("  time to first    %8.3f s\n", ttft);
      std::printf("  prefill          %8.1f tok/s\n", st.prefill_tok_s);
      std::printf("  decode           %8.1f tok/s\n", st.decode_tok_s);
      std::printf("  peak RSS (VmHWM) %8.1f MiB\n", hwm / M);
      std::printf("  RSS now          %8.1f MiB =\n", rss / M);
      std::printf("    weights (mapped .pte, resident) %8.1f MiB\n", weights_file / M);
      std::printf("    KV pool (resident / reserved)   %8.1f / %.1f MiB (in use %.1f MiB)\n", mu.pool_resident / M,
                  mu.pool_reserved / M, st.kv_bytes_in_use / M);
      for (const GroupStats& x : st.groups)
        std::printf("      layer group %s, %d layer(s): %d of %d blocks used (peak %d)\n",
                    x.window ? ("window " + std::to_string(x.window)).c_str() : "global", x.layers, x.used_blocks,
                    x.usable_blocks, x.peak_used_blocks);
      std::printf("    activations arena (resident)    %8.1f MiB\n", mu.activations_resident / M);
      std::printf("    shared libraries                %8.1f MiB\n", libs / M);
      std::printf("    rest (heap: packed weights, runtime) %.1f MiB\n", rest / M);
    }
  } catch (const RunnerError& e) {
    const int code = e.code() == ErrorCode::kModel || e.code() == ErrorCode::kAllocation ? 1 : 2;
    fail(e.what(), code);
  }
  return 0;
}
