#include "conversation_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "errors.h"

namespace pagedkv_rt {

namespace {

const char kMagic[8] = {'P', 'K', 'V', 'C', 'O', 'N', 'V', '\0'};
// sanity bounds (the Python reader's): a header field past these is damage, not a conversation
constexpr uint32_t kMaxLayers = 4096, kMaxHeads = 4096, kMaxHeadDim = 4096, kMaxTokens = 1u << 26;

[[noreturn]] void fail(const std::string& where, const std::string& what,
                       const std::string& fix = "it cannot be restored; save the conversation again") {
  throw RunnerError(ErrorCode::kArgument, "conversation file " + where + " " + what + ": " + fix + ".");
}

bool is_float_bits(uint32_t b) { return b == 16 || b == 32; }

// The spec is one the pool format allows (toolkit/kv_spec.py KVQuantSpec.validate, the parts that
// decide the record sizes); returns false otherwise.
bool spec_valid(const ConvSpec& s, uint32_t d) {
  auto bits_ok = [](uint32_t b) { return (b >= 2 && b <= 8) || is_float_bits(b); };
  if (!bits_ok(s.k_bits) || !bits_ok(s.v_bits) || is_float_bits(s.k_bits) != is_float_bits(s.v_bits)) return false;
  if (is_float_bits(s.k_bits) && (s.k_bits != s.v_bits || s.rotate || s.fp_tail || s.sink_blocks)) return false;
  for (uint32_t b : {s.k_sym, s.v_sym, s.rotate, s.fp_tail, s.sink_blocks})
    if (b > 1) return false;
  for (uint32_t g : {s.k_group, s.v_group})
    if (g > d || (g && d % g)) return false;
  return true;
}

// Record sizes the spec gives (POOL_FORMAT.md): codes bytes, scales bytes, codes item size.
void record_sizes(const ConvSpec& s, uint32_t d, uint32_t* code_bytes, uint32_t* scale_bytes, uint32_t* itemsize) {
  if (is_float_bits(s.k_bits)) {
    *itemsize = s.k_bits / 8;
    *code_bytes = 2 * d * *itemsize;
    *scale_bytes = 0;
    return;
  }
  const uint32_t kg = s.k_group ? s.k_group : d, vg = s.v_group ? s.v_group : d;
  *itemsize = 1;
  *code_bytes = d * (s.k_bits + s.v_bits) / 8;
  *scale_bytes = 2 * ((d / kg) * (s.k_sym ? 1 : 2) + (d / vg) * (s.v_sym ? 1 : 2));
}

struct Reader {
  const uint8_t* p;
  size_t n, pos = 0;
  const std::string& where;
  const uint8_t* take(size_t k, const char* what) {
    if (k > n - pos) fail(where, std::string("is truncated (it ends inside the ") + what + ")");
    const uint8_t* out = p + pos;
    pos += k;
    return out;
  }
  uint32_t u32(const char* what) {
    const uint8_t* b = take(4, what);
    return static_cast<uint32_t>(b[0]) | static_cast<uint32_t>(b[1]) << 8 | static_cast<uint32_t>(b[2]) << 16 |
           static_cast<uint32_t>(b[3]) << 24;
  }
};

void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

void put_bytes(std::vector<uint8_t>& out, const void* p, size_t n) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  out.insert(out.end(), b, b + n);
}

}  // namespace

bool ConvSpec::operator==(const ConvSpec& o) const {
  return k_bits == o.k_bits && v_bits == o.v_bits && k_group == o.k_group && v_group == o.v_group &&
         k_sym == o.k_sym && v_sym == o.v_sym && rotate == o.rotate && fp_tail == o.fp_tail &&
         sink_blocks == o.sink_blocks;
}

std::string ConvSpec::describe() const {
  std::ostringstream s;
  s << "K" << k_bits << "/V" << v_bits << " groups " << k_group << "/" << v_group << (k_sym ? " ksym" : " kasym")
    << (v_sym ? " vsym" : " vasym") << (rotate ? " rotate" : "") << (fp_tail ? " fp_tail" : "")
    << (sink_blocks ? " sink" : "");
  return s.str();
}

std::string group_spec_problem(const ConvSpec& pool, const ConvSpec& group, uint32_t head_dim, size_t index,
                               uint32_t window) {
  if (index == 0 || window == 0)
    return "layer group " + std::to_string(index) + " is not a sliding group after the first: only those store their "
           "own spec";
  if (is_float_bits(pool.k_bits) || is_float_bits(group.k_bits))
    return "a layer group's own spec needs quantized specs on both sides (" + group.describe() + " with the pool's " +
           pool.describe() + ")";
  if (!spec_valid(group, head_dim) || (head_dim * group.k_bits) % 8 || (head_dim * group.v_bits) % 8)
    return group.describe() + " is not a valid spec for head_dim " + std::to_string(head_dim);
  if (group.rotate != pool.rotate || group.fp_tail != pool.fp_tail || group.sink_blocks != pool.sink_blocks)
    return "its rotate/fp_tail/sink_blocks differ from the pool's (" + group.describe() + " with " + pool.describe() + ")";
  return "";
}

void ConversationFile::group_record_bytes(const ConvGroup& g, uint32_t* codes, uint32_t* scales) const {
  *codes = code_bytes, *scales = scale_bytes;
  uint32_t item = 0;
  if (!g.spec.none()) record_sizes(g.spec, head_dim, codes, scales, &item);
}

size_t ConvGroup::n_present() const {
  size_t k = 0;
  for (uint8_t b : present) k += b == kBlockDefault ? 1 : 0;
  return k;
}

size_t ConvGroup::n_compact() const {
  size_t k = 0;
  for (uint8_t b : present) k += b == kBlockCompact ? 1 : 0;
  return k;
}

uint32_t crc32(const uint8_t* data, size_t n, uint32_t crc) {
  static uint32_t table[256];
  static bool init = [] {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      table[i] = c;
    }
    return true;
  }();
  (void)init;
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ data[i]) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

ConversationFile parse_conversation(const uint8_t* data, size_t n, const std::string& where) {
  if (n < sizeof(kMagic) + 4 || std::memcmp(data, kMagic, sizeof(kMagic)) != 0)
    fail(where, "is not a pagedkv conversation file (bad magic)", "give a file written by /save or Engine.save");
  Reader hr{data, n, sizeof(kMagic), where};
  const uint32_t version = hr.u32("header");
  if (version < 1 || version > kConversationGroupSpecVersion)
    fail(where, "has format version " + std::to_string(version) + ", this runner reads 1, 2 and 3",
         "restore it with the pagedkv that saved it, or save the conversation again");
  if (n < sizeof(kMagic) + 8) fail(where, "is truncated (no checksum)");
  const size_t body = n - 4;
  Reader tail{data, n, body, where};
  if (crc32(data, body) != tail.u32("checksum")) fail(where, "is damaged or truncated (checksum mismatch)");

  Reader r{data, body, sizeof(kMagic) + 4, where};
  ConversationFile f;
  std::memcpy(f.model_sha256.data(), r.take(32, "model sha256"), 32);
  f.num_layers = r.u32("header");
  f.num_kv_heads = r.u32("header");
  f.head_dim = r.u32("header");
  f.block_size = r.u32("header");
  uint32_t* spec[] = {&f.spec.k_bits, &f.spec.v_bits, &f.spec.k_group, &f.spec.v_group, &f.spec.k_sym,
                      &f.spec.v_sym, &f.spec.rotate, &f.spec.fp_tail, &f.spec.sink_blocks};
  for (uint32_t* v : spec) *v = r.u32("spec");
  f.codes_itemsize = r.u32("header");
  f.code_bytes = r.u32("header");
  f.scale_bytes = r.u32("header");
  const uint32_t has_stage = r.u32("header");
  bool has_compact = false;  // version 2: the compact spec and record sizes (all zero: no compact blocks)
  if (version >= 2) {
    uint32_t* cspec[] = {&f.compact_spec.k_bits, &f.compact_spec.v_bits, &f.compact_spec.k_group,
                         &f.compact_spec.v_group, &f.compact_spec.k_sym, &f.compact_spec.v_sym,
                         &f.compact_spec.rotate, &f.compact_spec.fp_tail, &f.compact_spec.sink_blocks,
                         &f.compact_code_bytes, &f.compact_scale_bytes};
    for (uint32_t* v : cspec) {
      *v = r.u32("compact spec");
      has_compact = has_compact || *v;
    }
  }
  const uint32_t n_tokens = r.u32("header"), n_pending = r.u32("header"), n_groups = r.u32("header");
  if (!(f.num_layers >= 1 && f.num_layers <= kMaxLayers && f.num_kv_heads >= 1 && f.num_kv_heads <= kMaxHeads &&
        f.head_dim >= 1 && f.head_dim <= kMaxHeadDim && (f.block_size == 16 || f.block_size == 32) &&
        has_stage <= 1 && n_tokens <= kMaxTokens && n_pending <= kMaxTokens && n_groups >= 1 &&
        n_groups <= f.num_layers))
    fail(where, "has an impossible header (damaged)");
  f.has_stage = has_stage == 1;
  if (!spec_valid(f.spec, f.head_dim)) fail(where, "holds an invalid KV spec (" + f.spec.describe() + ")");
  uint32_t cb, sb, item;
  record_sizes(f.spec, f.head_dim, &cb, &sb, &item);
  if (cb != f.code_bytes || sb != f.scale_bytes || item != f.codes_itemsize)
    fail(where, "has record sizes its spec does not give (damaged)");
  if (has_compact) {  // toolkit/kv_spec.py check_compact: quantized both, the same rotation, fewer bytes
    const ConvSpec& c = f.compact_spec;
    if (!spec_valid(c, f.head_dim) || is_float_bits(c.k_bits) || is_float_bits(f.spec.k_bits) ||
        c.rotate != f.spec.rotate)
      fail(where, "holds an invalid compact spec (" + c.describe() + " for " + f.spec.describe() + ")");
    record_sizes(c, f.head_dim, &cb, &sb, &item);
    if (cb + sb >= f.code_bytes + f.scale_bytes)
      fail(where, "holds an invalid compact spec (" + c.describe() + " is not smaller than " + f.spec.describe() + ")");
    if (cb != f.compact_code_bytes || sb != f.compact_scale_bytes)
      fail(where, "has compact record sizes its compact spec does not give (damaged)");
  }
  const uint32_t n_blocks = (n_tokens + f.block_size - 1) / f.block_size, n_full = n_tokens / f.block_size;
  std::vector<uint8_t> seen(f.num_layers, 0);
  size_t covered = 0;
  for (uint32_t g = 0; g < n_groups; ++g) {
    ConvGroup grp;
    grp.window = r.u32("layer groups");
    if (version >= kConversationGroupSpecVersion) {  // the group's own spec (kv_spec.py check_stored_group_spec)
      uint32_t* gs[] = {&grp.spec.k_bits, &grp.spec.v_bits, &grp.spec.k_group, &grp.spec.v_group, &grp.spec.k_sym,
                        &grp.spec.v_sym, &grp.spec.rotate, &grp.spec.fp_tail, &grp.spec.sink_blocks};
      for (uint32_t* v : gs) *v = r.u32("layer groups");
      const ConvSpec& s = grp.spec;
      if (const std::string why = s.none() ? "" : group_spec_problem(f.spec, s, f.head_dim, g, grp.window);
          !why.empty())
        fail(where, "holds an invalid layer-group spec (damaged: " + why + ")");
    }
    const uint32_t nl = r.u32("layer groups");
    if (nl < 1 || nl > f.num_layers) fail(where, "has an impossible layer group (damaged)");
    for (uint32_t i = 0; i < nl; ++i) {
      const uint32_t l = r.u32("layer groups");
      if (l >= f.num_layers || seen[l]) fail(where, "has an impossible layer group (damaged)");
      seen[l] = 1;
      ++covered;
      grp.layers.push_back(l);
    }
    const uint32_t nb = r.u32("layer groups");
    if (nb != n_blocks) fail(where, "has an impossible layer group (damaged)");
    const uint8_t* pr = r.take(nb, "layer groups");
    grp.present.assign(pr, pr + nb);
    for (uint32_t i = 0; i < nb; ++i) {
      const uint8_t b = grp.present[i];
      if (b > (version >= 2 ? kBlockCompact : kBlockDefault)) fail(where, "has an impossible layer group (damaged)");
      // compact blocks: only full blocks of a global group, and only with a compact spec
      if (b == kBlockCompact && (grp.window || !has_compact || i >= n_full))
        fail(where, "has a compact block where none can be (damaged)");
    }
    f.groups.push_back(std::move(grp));
  }
  if (covered != f.num_layers) fail(where, "has layer groups that do not cover every layer (damaged)");
  if (has_compact && !f.n_compact()) fail(where, "has a compact spec but no compact block (damaged)");
  if (version >= kConversationGroupSpecVersion && !f.has_group_specs())
    fail(where, "has format version " + std::to_string(version) + " but no layer group with its own spec (damaged)");
  for (auto* v : {&f.tokens, &f.pending}) {
    const uint32_t count = v == &f.tokens ? n_tokens : n_pending;
    const uint8_t* b = r.take(static_cast<size_t>(count) * 4, "tokens");
    v->resize(count);
    if (count) std::memcpy(v->data(), b, static_cast<size_t>(count) * 4);  // little-endian hosts only
    for (int32_t t : *v)
      if (t < 0) fail(where, "holds a negative token id (damaged)");
  }
  const uint32_t n_app = r.u32("application data");
  const uint8_t* app = r.take(n_app, "application data");
  f.app.assign(reinterpret_cast<const char*>(app), n_app);
  f.codes.resize(f.num_layers);
  f.scales.resize(f.num_layers);
  f.compact_codes.resize(f.num_layers);
  f.compact_scales.resize(f.num_layers);
  auto records = [&](std::vector<uint8_t>& out, size_t blocks, uint32_t width, const std::string& what) {
    const size_t k = blocks * f.block_record_bytes(width);
    const uint8_t* b = r.take(k, what.c_str());
    out.assign(b, b + k);
  };
  for (const ConvGroup& grp : f.groups) {
    const size_t np = grp.n_present(), nc = grp.n_compact();
    uint32_t gcb = 0, gsb = 0;
    f.group_record_bytes(grp, &gcb, &gsb);
    for (uint32_t l : grp.layers) {
      const std::string layer = " of layer " + std::to_string(l);
      records(f.codes[l], np, gcb, "codes" + layer);
      if (gsb) records(f.scales[l], np, gsb, "scales" + layer);
      if (nc) {
        records(f.compact_codes[l], nc, f.compact_code_bytes, "compact codes" + layer);
        records(f.compact_scales[l], nc, f.compact_scale_bytes, "compact scales" + layer);
      }
    }
  }
  if (f.has_stage) {
    f.stage.resize(f.num_layers);
    for (uint32_t l = 0; l < f.num_layers; ++l) {
      const std::string what = "stage rows of layer " + std::to_string(l);
      const uint8_t* s = r.take(f.stage_bytes(), what.c_str());
      f.stage[l].assign(s, s + f.stage_bytes());
    }
  }
  if (r.pos != body) fail(where, "has " + std::to_string(body - r.pos) + " unexpected byte(s) after its data (damaged)");
  return f;
}

ConversationFile read_conversation_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "does not exist or cannot be read", "check the name");
  std::vector<uint8_t> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_conversation(data.data(), data.size(), path);
}

std::vector<uint8_t> encode_conversation(const ConversationFile& f) {
  const uint32_t n_blocks = (static_cast<uint32_t>(f.tokens.size()) + f.block_size - 1) / f.block_size;
  auto bad = [](const std::string& m) { throw RunnerError(ErrorCode::kArgument, "cannot encode conversation: " + m); };
  if (f.codes.size() != f.num_layers || (f.scale_bytes && f.scales.size() != f.num_layers) ||
      (f.has_stage && f.stage.size() != f.num_layers))
    bad("one array per layer is needed");
  std::vector<uint8_t> out(kMagic, kMagic + sizeof(kMagic));
  const uint32_t version = f.has_group_specs() ? kConversationGroupSpecVersion : kConversationFormatVersion;
  put_u32(out, version);
  put_bytes(out, f.model_sha256.data(), 32);
  // the compact spec and sizes only when the file holds compact blocks (else zeros), as the Python writer
  const bool compact = f.n_compact() > 0;
  if (compact && f.compact_spec.none()) bad("compact blocks need their compact spec");
  const ConvSpec& c = f.compact_spec;
  for (uint32_t v : {f.num_layers, f.num_kv_heads, f.head_dim, f.block_size, f.spec.k_bits, f.spec.v_bits,
                     f.spec.k_group, f.spec.v_group, f.spec.k_sym, f.spec.v_sym, f.spec.rotate, f.spec.fp_tail,
                     f.spec.sink_blocks, f.codes_itemsize, f.code_bytes, f.scale_bytes,
                     static_cast<uint32_t>(f.has_stage)})
    put_u32(out, v);
  for (uint32_t v : {c.k_bits, c.v_bits, c.k_group, c.v_group, c.k_sym, c.v_sym, c.rotate, c.fp_tail, c.sink_blocks,
                     f.compact_code_bytes, f.compact_scale_bytes})
    put_u32(out, compact ? v : 0);
  for (uint32_t v : {static_cast<uint32_t>(f.tokens.size()), static_cast<uint32_t>(f.pending.size()),
                     static_cast<uint32_t>(f.groups.size())})
    put_u32(out, v);
  for (const ConvGroup& g : f.groups) {
    if (g.present.size() != n_blocks) bad("a group's present list must have one entry per logical block");
    put_u32(out, g.window);
    if (version >= kConversationGroupSpecVersion)  // the group's own spec, all zero for the file's
      for (uint32_t v : {g.spec.k_bits, g.spec.v_bits, g.spec.k_group, g.spec.v_group, g.spec.k_sym, g.spec.v_sym,
                         g.spec.rotate, g.spec.fp_tail, g.spec.sink_blocks})
        put_u32(out, v);
    put_u32(out, static_cast<uint32_t>(g.layers.size()));
    for (uint32_t l : g.layers) put_u32(out, l);
    put_u32(out, n_blocks);
    put_bytes(out, g.present.data(), g.present.size());
  }
  put_bytes(out, f.tokens.data(), f.tokens.size() * 4);
  put_bytes(out, f.pending.data(), f.pending.size() * 4);
  put_u32(out, static_cast<uint32_t>(f.app.size()));
  put_bytes(out, f.app.data(), f.app.size());
  for (const ConvGroup& g : f.groups) {
    const size_t np = g.n_present(), nc = g.n_compact();
    uint32_t gcb = 0, gsb = 0;
    f.group_record_bytes(g, &gcb, &gsb);
    for (uint32_t l : g.layers) {
      if (l >= f.num_layers || f.codes[l].size() != np * f.block_record_bytes(gcb) ||
          (gsb && f.scales[l].size() != np * f.block_record_bytes(gsb)))
        bad("layer " + std::to_string(l) + "'s records do not match its group's present blocks");
      put_bytes(out, f.codes[l].data(), f.codes[l].size());
      if (gsb) put_bytes(out, f.scales[l].data(), f.scales[l].size());
      if (nc) {
        if (f.compact_codes.size() != f.num_layers || f.compact_scales.size() != f.num_layers ||
            f.compact_codes[l].size() != nc * f.block_record_bytes(f.compact_code_bytes) ||
            f.compact_scales[l].size() != nc * f.block_record_bytes(f.compact_scale_bytes))
          bad("layer " + std::to_string(l) + "'s compact records do not match its group's compact blocks");
        put_bytes(out, f.compact_codes[l].data(), f.compact_codes[l].size());
        put_bytes(out, f.compact_scales[l].data(), f.compact_scales[l].size());
      }
    }
  }
  if (f.has_stage)
    for (const auto& s : f.stage) {
      if (s.size() != f.stage_bytes()) bad("a stage row block has the wrong size");
      put_bytes(out, s.data(), s.size());
    }
  put_u32(out, crc32(out.data(), out.size()));
  return out;
}

size_t write_conversation_file(const std::string& path, const ConversationFile& f) {
  const std::vector<uint8_t> data = encode_conversation(f);
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  const std::string tmp = dir + "." + name + ".tmp-" + std::to_string(getpid());
  auto fail_io = [&](const char* what) {
    const std::string err = std::strerror(errno);
    unlink(tmp.c_str());
    throw RunnerError(ErrorCode::kArgument, "cannot write conversation file " + path + " (" + what + ": " + err +
                                                "): free some space or choose another path; nothing was changed.");
  };
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail_io("open");
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t w = ::write(fd, data.data() + done, data.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      close(fd);
      fail_io("write");
    }
    done += static_cast<size_t>(w);
  }
  if (fsync(fd) != 0) {
    close(fd);
    fail_io("fsync");
  }
  if (close(fd) != 0) fail_io("close");
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail_io("rename");
  return data.size();
}

void check_conversation_compatible(const ConversationFile& f, const ConversationFile& want, const std::string& where) {
  const std::string fix = "restore it with the artifacts that saved it";
  if (f.model_sha256 != want.model_sha256) fail(where, "was saved with another model", fix);
  const std::pair<const char*, std::pair<uint32_t, uint32_t>> dims[] = {
      {"num_layers", {f.num_layers, want.num_layers}},       {"num_kv_heads", {f.num_kv_heads, want.num_kv_heads}},
      {"head_dim", {f.head_dim, want.head_dim}},             {"block_size", {f.block_size, want.block_size}},
      {"codes_itemsize", {f.codes_itemsize, want.codes_itemsize}}, {"code_bytes", {f.code_bytes, want.code_bytes}},
      {"scale_bytes", {f.scale_bytes, want.scale_bytes}},    {"has_stage", {f.has_stage, want.has_stage}}};
  for (const auto& d : dims)
    if (d.second.first != d.second.second)
      fail(where, std::string("has ") + d.first + "=" + std::to_string(d.second.first) + ", this pool has " +
                      std::to_string(d.second.second), fix);
  if (!(f.spec == want.spec))
    fail(where, "was saved with KV spec " + f.spec.describe() + ", this pool is " + want.spec.describe(), fix);
  bool same = f.groups.size() == want.groups.size();
  for (size_t g = 0; same && g < f.groups.size(); ++g)
    same = f.groups[g].window == want.groups[g].window && f.groups[g].layers == want.groups[g].layers;
  if (!same) fail(where, "has other layer groups than this pool", fix);
  for (size_t g = 0; g < f.groups.size(); ++g)
    if (!(f.groups[g].spec == want.groups[g].spec))
      fail(where, "has other layer-group specs than this pool (group " + std::to_string(g) + ": " +
                      (f.groups[g].spec.none() ? std::string("the pool's") : f.groups[g].spec.describe()) + ", here " +
                      (want.groups[g].spec.none() ? std::string("the pool's") : want.groups[g].spec.describe()) + ")",
           fix);
  if (const size_t nc = f.n_compact()) {  // compact blocks go into the pool's compact region, in its spec
    if (want.compact_spec.none())
      fail(where, "holds " + std::to_string(nc) + " block(s) in the compact tier (re-quantized to " +
                      f.compact_spec.describe() + "), this pool has no compact region",
           "restore it with artifacts exported with a compact region (`pagedkv export --compact-blocks N`; "
           "pagedkv's engine: a model compiled with compact_blocks=N), or save it before compacting");
    if (!(f.compact_spec == want.compact_spec) || f.compact_code_bytes != want.compact_code_bytes ||
        f.compact_scale_bytes != want.compact_scale_bytes)
      fail(where, "holds compact blocks in spec " + f.compact_spec.describe() + ", this pool's compact region is " +
                      want.compact_spec.describe(), fix);
  }
}

}  // namespace pagedkv_rt
