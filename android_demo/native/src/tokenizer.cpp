#include "tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <queue>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "json.h"

namespace pagedkv_rt {

namespace {

#include "unicode_tables.inc"

template <size_t N>
bool in_ranges(const uint32_t (&r)[N][2], uint32_t cp) {
  size_t lo = 0, hi = N;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (cp < r[mid][0]) hi = mid;
    else if (cp > r[mid][1]) lo = mid + 1;
    else return true;
  }
  return false;
}

bool is_letter(uint32_t cp) {
  if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  return in_ranges(kLetterRanges, cp);
}
bool is_number(uint32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return in_ranges(kNumberRanges, cp);
}
// Unicode White_Space (what \s matches in the Rust regex engines HF tokenizers uses).
bool is_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

// Whether cp may change under NFC or take part in a composition (NFC_Quick_Check No/Maybe, or a
// nonzero canonical combining class): text without such code points is already NFC.
bool nfc_unstable(uint32_t cp) { return cp >= 0x300 && in_ranges(kNfcUnstableRanges, cp); }

// The Split regexes this runner implements by hand (llama3_split): Qwen2's (one digit per piece) and
// Llama 3's (up to three), exactly as HF tokenizer.json files spell them.
const char* const kQwen2Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const char* const kLlama3Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

struct Cp {
  uint32_t cp;
  size_t off, len;  // byte range in the text
};

std::vector<Cp> decode_utf8(const std::string& s) {
  std::vector<Cp> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {  // an invalid byte is one "other" code point (U+FFFD)
    uint32_t cp;
    const size_t n = next_utf8(s, i, &cp);
    out.push_back({cp, i, n});
    i += n;
  }
  return out;
}

// This runner has no NFC tables: it refuses the (rare) text that NFC would change, so what it
// tokenizes is what HF's NFC normalizer would give. Keyboards produce composed text already.
void require_nfc(const std::string& text) {
  for (size_t i = 0; i < text.size();) {
    uint32_t cp;
    i += next_utf8(text, i, &cp);
    if (nfc_unstable(cp)) {
      char hex[16];
      std::snprintf(hex, sizeof hex, "U+%04X", cp);
      throw std::invalid_argument(std::string("the text has ") + hex + ", which Unicode NFC normalization (this "
                                  "tokenizer's normalizer) may change: normalize it to NFC first (java.text."
                                  "Normalizer, Form.NFC; Python unicodedata.normalize('NFC', text))");
    }
  }
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path + ": is the artifacts directory complete?");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

std::vector<std::string> gpt2_split(const std::string& text) {
  std::vector<Cp> cps = decode_utf8(text);
  std::vector<std::string> out;
  const size_t n = cps.size();
  size_t i = 0;
  auto piece = [&](size_t a, size_t b) {  // code points [a, b)
    out.push_back(text.substr(cps[a].off, cps[b - 1].off + cps[b - 1].len - cps[a].off));
  };
  auto other = [](uint32_t c) { return !is_space(c) && !is_letter(c) && !is_number(c); };
  while (i < n) {
    uint32_t c = cps[i].cp;
    // 's|'t|'re|'ve|'m|'ll|'d
    if (c == '\'' && i + 1 < n) {
      uint32_t a = cps[i + 1].cp, b = i + 2 < n ? cps[i + 2].cp : 0;
      size_t len = 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') len = 2;
      else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) len = 3;
      if (len) {
        piece(i, i + len);
        i += len;
        continue;
      }
    }
    // ` ?X+` for X in letter, number, other
    size_t start = i, j = i;
    if (c == ' ' && i + 1 < n) j = i + 1;
    uint32_t d = cps[j].cp;
    bool (*cls)(uint32_t) = nullptr;
    if (is_letter(d)) cls = is_letter;
    else if (is_number(d)) cls = is_number;
    else if (other(d)) cls = +[](uint32_t x) { return !is_space(x) && !is_letter(x) && !is_number(x); };
    if (cls && (j == i || c == ' ')) {
      size_t k = j;
      while (k < n && cls(cps[k].cp)) ++k;
      piece(start, k);
      i = k;
      continue;
    }
    // \s+(?!\S) | \s+
    if (is_space(c)) {
      size_t k = i;
      while (k < n && is_space(cps[k].cp)) ++k;
      if (k < n && k - i >= 2) k -= 1;  // leave the last space to prefix the next word
      piece(i, k);
      i = k;
      continue;
    }
    piece(i, i + 1);  // unreachable for valid classes, kept for safety
    ++i;
  }
  return out;
}

std::vector<std::string> llama3_split(const std::string& text, int max_digits) {
  std::vector<Cp> cps = decode_utf8(text);
  std::vector<std::string> out;
  const size_t n = cps.size();
  auto piece = [&](size_t a, size_t b) {  // code points [a, b)
    out.push_back(text.substr(cps[a].off, cps[b - 1].off + cps[b - 1].len - cps[a].off));
  };
  auto at = [&](size_t k) { return k < n ? cps[k].cp : 0xFFFFFFFFu; };  // past the end: matches no class
  auto newline = [](uint32_t c) { return c == '\r' || c == '\n'; };
  auto other = [](uint32_t c) { return c != 0xFFFFFFFFu && !is_space(c) && !is_letter(c) && !is_number(c); };
  auto letter = [](uint32_t c) { return c != 0xFFFFFFFFu && is_letter(c); };
  auto lower = [](uint32_t c) { return c < 0x80 ? (c | 0x20) : c; };
  size_t i = 0;
  while (i < n) {
    const uint32_t c = cps[i].cp;
    // (?i:'s|'t|'re|'ve|'m|'ll|'d): case-insensitive as Unicode simple case folding has it ('s: also U+017F)
    if (c == '\'' && i + 1 < n) {
      const uint32_t a = lower(at(i + 1)), b = lower(at(i + 2));
      size_t len = 0;
      if (a == 's' || a == 0x17F || a == 't' || a == 'm' || a == 'd') len = 2;
      else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) len = 3;
      if (len) {
        piece(i, i + len);
        i += len;
        continue;
      }
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    {
      size_t j = i;
      if (!newline(c) && !is_letter(c) && !is_number(c) && letter(at(i + 1))) j = i + 1;
      if (letter(at(j))) {
        size_t k = j;
        while (letter(at(k))) ++k;
        piece(i, k);
        i = k;
        continue;
      }
    }
    // \p{N}{1,max_digits}
    if (is_number(c)) {
      size_t k = i;
      while (k < n && k - i < static_cast<size_t>(max_digits) && is_number(cps[k].cp)) ++k;
      piece(i, k);
      i = k;
      continue;
    }
    // ' '?[^\s\p{L}\p{N}]+[\r\n]*
    {
      const size_t j = c == ' ' && other(at(i + 1)) ? i + 1 : i;
      if (other(at(j))) {
        size_t k = j;
        while (other(at(k))) ++k;
        while (k < n && newline(cps[k].cp)) ++k;
        piece(i, k);
        i = k;
        continue;
      }
    }
    // what is left starts with white space: \s*[\r\n]+ | \s+(?!\S) | \s+
    size_t k = i, last_newline = n;
    while (k < n && is_space(cps[k].cp)) {
      if (newline(cps[k].cp)) last_newline = k;
      ++k;
    }
    if (last_newline < n) k = last_newline + 1;       // \s*[\r\n]+ ends after the run's last newline
    else if (k < n && k - i >= 2) k -= 1;              // \s+(?!\S): leave the last space to the next piece
    piece(i, k);
    i = k;
  }
  return out;
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  Json j;
  try {
    j = Json::parse(read_file(path));
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(path + ": " + e.what());
  }
  return from_json(j);
}

Tokenizer Tokenizer::from_json(const Json& j) {
  Tokenizer t;
  const Json& model = j["model"];
  const Json* type = model.find("type");
  if (type && type->as_string() != "BPE")
    throw std::runtime_error("tokenizer.json model type '" + type->as_string() +
                             "' is not supported: this runner reads BPE tokenizers only (byte-level or "
                             "SentencePiece-style)");
  auto type_of = [](const Json* p) { return (!p || p->is_null()) ? std::string() : (*p)["type"].as_string(); };
  auto unsupported = [](const char* what, const std::string& type) {
    return std::runtime_error(std::string("tokenizer.json ") + what + " '" + type +
                              "' is not supported: this runner reads byte-level (GPT-2 style) and "
                              "SentencePiece-style (Gemma) BPE tokenizers only");
  };
  // a Replace step whose pattern is a plain string: (from, to)
  auto replace_step = [&](const Json& r, const char* what) {
    const Json* str = r["pattern"].find("String");
    if (!str) throw unsupported(what, "Replace with a regex pattern");
    return std::make_pair(str->as_string(), r["content"].as_string());
  };
  const Json* pre = j.find("pre_tokenizer");
  const Json* dec = j.find("decoder");
  const Json* norm = j.find("normalizer");
  const std::string pre_t = type_of(pre), dec_t = type_of(dec), norm_t = type_of(norm);
  t.byte_level_ = pre_t == "ByteLevel" || dec_t == "ByteLevel" || (pre_t.empty() && dec_t.empty() && norm_t.empty());
  if (t.byte_level_) {
    if (!dec_t.empty() && dec_t != "ByteLevel") throw unsupported("decoder", dec_t);
    if (norm_t == "NFC") t.nfc_ = true;
    else if (!norm_t.empty())
      throw std::runtime_error("tokenizer.json has a normalizer (" + norm_t +
                               ") with a ByteLevel tokenizer: not supported by this runner (NFC only)");
    const Json* byte_level = pre_t == "ByteLevel" ? pre : nullptr;
    if (pre_t == "Sequence") {  // Split on a known regex, then ByteLevel without its own regex
      const auto& steps = (*pre)["pretokenizers"].items();
      if (steps.size() != 2 || type_of(&steps[0]) != "Split" || type_of(&steps[1]) != "ByteLevel")
        throw unsupported("pre_tokenizer", "Sequence other than [Split, ByteLevel]");
      const Json& split = steps[0];
      const Json* regex = split["pattern"].find("Regex");
      if (!regex || split["behavior"].as_string() != "Isolated" || (split.has("invert") && split["invert"].as_bool()))
        throw unsupported("pre_tokenizer", "Split other than an Isolated regex");
      if (regex->as_string() == kQwen2Pattern) t.split_ = Split::kQwen2;
      else if (regex->as_string() == kLlama3Pattern) t.split_ = Split::kLlama3;
      else throw unsupported("pre_tokenizer", "Split regex " + regex->as_string());
      byte_level = &steps[1];
      if (const Json* r = byte_level->find("use_regex"); r && r->as_bool())
        throw unsupported("pre_tokenizer", "ByteLevel with its regex after a Split");
    } else if (!pre_t.empty() && !byte_level) {
      throw unsupported("pre_tokenizer", pre_t);
    }
    if (byte_level) {
      if (const Json* r = byte_level->find("use_regex"); r && !r->as_bool() && t.split_ == Split::kGpt2)
        t.split_ = Split::kNone;
      if (const Json* a = byte_level->find("add_prefix_space")) t.add_prefix_space_ = a->as_bool();
    }
  } else {
    if (norm_t == "Replace") {
      t.normalize_.push_back(replace_step(*norm, "normalizer"));
    } else if (norm_t == "Sequence") {
      for (const Json& n : (*norm)["normalizers"].items()) {
        if (type_of(&n) != "Replace") throw unsupported("normalizer", type_of(&n));
        t.normalize_.push_back(replace_step(n, "normalizer"));
      }
    } else if (!norm_t.empty()) {
      throw unsupported("normalizer", norm_t);
    }
    if (pre_t == "Split") {
      const Json* str = (*pre)["pattern"].find("String");
      if (!str || (*pre)["behavior"].as_string() != "MergedWithPrevious" ||
          (pre->has("invert") && (*pre)["invert"].as_bool()))
        throw unsupported("pre_tokenizer", "Split other than on a string, MergedWithPrevious");
      t.split_after_ = str->as_string();
    } else if (!pre_t.empty()) {
      throw unsupported("pre_tokenizer", pre_t);
    }
    std::vector<const Json*> steps;
    if (dec_t == "Sequence") {
      for (const Json& d : (*dec)["decoders"].items()) steps.push_back(&d);
    } else if (!dec_t.empty()) {
      steps.push_back(dec);
    }
    for (const Json* d : steps) {
      const std::string dt = type_of(d);
      if (dt == "Replace") t.decode_replace_.push_back(replace_step(*d, "decoder"));
      else if (dt != "ByteFallback" && dt != "Fuse") throw unsupported("decoder", dt);
    }
    if (const Json* bf = model.find("byte_fallback"); bf && !bf->is_null()) t.byte_fallback_ = bf->as_bool();
  }
  if (const Json* im = model.find("ignore_merges"); im && !im->is_null()) t.ignore_merges_ = im->as_bool();

  // GPT-2's byte <-> printable code point table
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + extra++);
    append_utf8(t.byte_to_mapped_[b], cp);
    t.mapped_to_byte_[cp] = static_cast<uint8_t>(b);
  }

  int32_t max_id = -1;
  for (const auto& kv : model["vocab"].members()) {
    int32_t id = static_cast<int32_t>(kv.second.as_int());
    t.vocab_[kv.first] = id;
    max_id = std::max(max_id, id);
  }
  if (const Json* added = j.find("added_tokens"))
    for (const Json& a : added->items()) max_id = std::max(max_id, static_cast<int32_t>(a["id"].as_int()));
  t.id_to_token_.assign(static_cast<size_t>(max_id + 1), std::string());
  t.id_special_.assign(static_cast<size_t>(max_id + 1), 0);
  for (const auto& kv : t.vocab_) t.id_to_token_[static_cast<size_t>(kv.second)] = kv.first;
  if (const Json* unk = model.find("unk_token"); unk && !unk->is_null()) {
    auto it = t.vocab_.find(unk->as_string());
    if (it != t.vocab_.end()) t.unk_id_ = it->second;
  }

  const auto& merges = model["merges"].items();
  t.merge_rank_.reserve(merges.size() * 2);
  for (size_t r = 0; r < merges.size(); ++r) {
    std::string a, b;
    if (merges[r].is_array()) {  // tokenizers >= 0.20: ["a", "b"]
      a = merges[r][0].as_string();
      b = merges[r][1].as_string();
    } else {  // "a b"
      const std::string& s = merges[r].as_string();
      size_t sp = s.find(' ', 1);
      if (sp == std::string::npos) throw std::runtime_error("tokenizer.json merge '" + s + "' has no space");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    }
    t.merge_rank_.emplace(a + '\x01' + b, static_cast<int32_t>(r));
  }

  if (const Json* added = j.find("added_tokens")) {
    for (const Json& a : added->items()) {
      AddedToken at{a["content"].as_string(), static_cast<int32_t>(a["id"].as_int()),
                    a.has("special") && a["special"].as_bool()};
      t.id_to_token_[static_cast<size_t>(at.id)] = at.content;
      t.id_special_[static_cast<size_t>(at.id)] = at.special ? 2 : 1;
      t.added_.push_back(at);
    }
    std::stable_sort(t.added_.begin(), t.added_.end(),
                     [](const AddedToken& x, const AddedToken& y) { return x.content.size() > y.content.size(); });
  }
  t.added_by_byte_.assign(256, {});
  for (size_t k = 0; k < t.added_.size(); ++k)
    if (!t.added_[k].content.empty()) t.added_by_byte_[static_cast<unsigned char>(t.added_[k].content[0])].push_back(k);

  if (const Json* pp = j.find("post_processor"); pp && !pp->is_null() && (*pp)["type"].as_string() == "TemplateProcessing") {
    bool seen_a = false;
    for (const Json& item : (*pp)["single"].items()) {
      if (item.has("Sequence")) {
        seen_a = true;
      } else if (const Json* st = item.find("SpecialToken")) {
        const std::string& name = (*st)["id"].as_string();
        for (const Json& id : (*pp)["special_tokens"][name]["ids"].items())
          (seen_a ? t.suffix_ids_ : t.prefix_ids_).push_back(static_cast<int32_t>(id.as_int()));
      }
    }
  }
  return t;
}

int32_t Tokenizer::token_id(const std::string& content) const {
  for (const auto& a : added_)
    if (a.content == content) return a.id;
  std::string mapped;
  if (byte_level_) {
    for (unsigned char c : content) mapped += byte_to_mapped_[c];
  } else {
    mapped = content;
  }
  auto it = vocab_.find(mapped);
  return it == vocab_.end() ? -1 : it->second;
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < id_special_.size() && id_special_[static_cast<size_t>(id)] == 2;
}

// Merges adjacent symbols in place: always the pair of lowest merge rank, the leftmost among equal
// ranks (a min-heap of (rank, position) over a linked list; stale entries are skipped when popped).
void Tokenizer::merge(std::vector<std::string>& sym) const {
  const int n = static_cast<int>(sym.size());
  if (n < 2) return;
  std::vector<int> prev(n), next(n);
  for (int k = 0; k < n; ++k) {
    prev[k] = k - 1;
    next[k] = k + 1 < n ? k + 1 : -1;
  }
  std::vector<char> alive(n, 1);
  std::string key;
  auto rank_of = [&](int a, int b) {
    key.assign(sym[a]).append(1, '\x01').append(sym[b]);
    auto it = merge_rank_.find(key);
    return it == merge_rank_.end() ? -1 : it->second;
  };
  using Entry = std::pair<int32_t, int>;  // (rank, left position)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (int k = 0; k + 1 < n; ++k)
    if (int32_t r = rank_of(k, k + 1); r >= 0) heap.push({r, k});
  while (!heap.empty()) {
    const auto [r, at] = heap.top();
    heap.pop();
    if (!alive[at] || next[at] < 0 || rank_of(at, next[at]) != r) continue;  // stale entry
    const int right = next[at];
    sym[at] += sym[right];
    sym[right].clear();
    alive[right] = 0;
    next[at] = next[right];
    if (next[at] >= 0) prev[next[at]] = at;
    if (prev[at] >= 0)
      if (int32_t pr = rank_of(prev[at], at); pr >= 0) heap.push({pr, prev[at]});
    if (next[at] >= 0)
      if (int32_t nr = rank_of(at, next[at]); nr >= 0) heap.push({nr, at});
  }
  std::vector<std::string> kept;
  for (int k = 0; k >= 0 && k < n; k = next[k]) kept.push_back(std::move(sym[k]));
  sym.swap(kept);
}

void Tokenizer::bpe_word(const std::string& word_bytes, std::vector<int32_t>& out) const {
  auto hit = cache_.find(word_bytes);
  if (hit != cache_.end()) {
    out.insert(out.end(), hit->second.begin(), hit->second.end());
    return;
  }
  std::vector<std::string> sym;
  sym.reserve(word_bytes.size());
  std::string whole;
  if (byte_level_) {
    for (unsigned char c : word_bytes) {
      sym.push_back(byte_to_mapped_[c]);
      whole += byte_to_mapped_[c];
    }
  } else {  // code points; one missing from the vocab becomes its bytes' <0xHH> tokens (or unk)
    whole = word_bytes;
    for (const Cp& cp : decode_utf8(word_bytes)) {
      std::string one = word_bytes.substr(cp.off, cp.len);
      if (vocab_.count(one) || !byte_fallback_) {
        sym.push_back(std::move(one));
        continue;
      }
      for (unsigned char c : one) {
        char hex[8];
        std::snprintf(hex, sizeof hex, "<0x%02X>", c);
        sym.push_back(hex);
      }
    }
  }
  std::vector<int32_t> ids;
  auto whole_it = ignore_merges_ ? vocab_.find(whole) : vocab_.end();
  if (whole_it != vocab_.end()) {
    ids.push_back(whole_it->second);
  } else {
    merge(sym);
    for (const auto& s : sym) {
      auto it = vocab_.find(s);
      if (it != vocab_.end()) {
        ids.push_back(it->second);
      } else if (!byte_level_) {  // no byte fallback: the unknown token (consecutive ones fused)
        if (unk_id_ >= 0 && (ids.empty() || ids.back() != unk_id_)) ids.push_back(unk_id_);
      } else {  // not in the vocab (incomplete alphabet): fall back to its single bytes if they exist
        std::vector<Cp> cps = decode_utf8(s);
        for (const Cp& cp : cps) {
          std::string one;
          append_utf8(one, cp.cp);
          auto it2 = vocab_.find(one);
          if (it2 != vocab_.end()) ids.push_back(it2->second);
        }
      }
    }
  }
  if (cache_.size() < 100000 && word_bytes.size() < 256) cache_.emplace(word_bytes, ids);
  out.insert(out.end(), ids.begin(), ids.end());
}

void Tokenizer::encode_plain(const std::string& text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  std::string t = text;
  if (!byte_level_) {
    for (const auto& [from, to] : normalize_) {
      if (from.empty()) continue;
      std::string r;
      for (size_t i = 0; i < t.size();) {
        if (t.compare(i, from.size(), from) == 0) {
          r += to;
          i += from.size();
        } else {
          r += t[i++];
        }
      }
      t.swap(r);
    }
    if (split_after_.empty()) return bpe_word(t, out);
    size_t a = 0;  // pieces end after each occurrence of the split string (MergedWithPrevious)
    for (size_t f; (f = t.find(split_after_, a)) != std::string::npos; a = f + split_after_.size())
      bpe_word(t.substr(a, f + split_after_.size() - a), out);
    if (a < t.size()) bpe_word(t.substr(a), out);
    return;
  }
  if (nfc_) require_nfc(t);
  if (add_prefix_space_ && t[0] != ' ') t.insert(t.begin(), ' ');
  switch (split_) {
    case Split::kGpt2:
      for (const std::string& w : gpt2_split(t)) bpe_word(w, out);
      break;
    case Split::kQwen2:
    case Split::kLlama3:
      for (const std::string& w : llama3_split(t, split_ == Split::kQwen2 ? 1 : 3)) bpe_word(w, out);
      break;
    case Split::kNone:
      bpe_word(t, out);
  }
}

std::vector<int32_t> Tokenizer::encode(const std::string& text, bool add_special) const {
  std::vector<int32_t> out;
  if (add_special) out = prefix_ids_;
  size_t seg = 0, i = 0;
  while (i < text.size()) {
    const AddedToken* match = nullptr;
    for (size_t k : added_by_byte_[static_cast<unsigned char>(text[i])]) {  // longest first
      if (text.compare(i, added_[k].content.size(), added_[k].content) == 0) {
        match = &added_[k];
        break;
      }
    }
    if (!match) {
      ++i;
      continue;
    }
    encode_plain(text.substr(seg, i - seg), out);
    out.push_back(match->id);
    i += match->content.size();
    seg = i;
  }
  encode_plain(text.substr(seg), out);
  if (add_special) out.insert(out.end(), suffix_ids_.begin(), suffix_ids_.end());
  return out;
}

std::string Tokenizer::token_bytes(int32_t id, bool skip_special) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size()) return std::string();
  const size_t u = static_cast<size_t>(id);
  if (id_special_[u]) return (id_special_[u] == 2 && skip_special) ? std::string() : id_to_token_[u];
  if (!byte_level_) {
    const std::string& tok = id_to_token_[u];
    unsigned hexv;
    char tail;
    if (byte_fallback_ && tok.size() == 6 && std::sscanf(tok.c_str(), "<0x%2X%c", &hexv, &tail) == 2 && tail == '>')
      return std::string(1, static_cast<char>(hexv));
    std::string out = tok;
    for (const auto& [from, to] : decode_replace_) {
      if (from.empty()) continue;
      for (size_t f = 0; (f = out.find(from, f)) != std::string::npos; f += to.size()) out.replace(f, from.size(), to);
    }
    return out;
  }
  std::string out;
  for (const Cp& cp : decode_utf8(id_to_token_[u])) {
    auto it = mapped_to_byte_.find(cp.cp);
    if (it != mapped_to_byte_.end()) out += static_cast<char>(it->second);
    else out += id_to_token_[u].substr(cp.off, cp.len);
  }
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string out;
  for (int32_t id : ids) out += token_bytes(id, skip_special);
  return out;
}

std::string TokenStreamer::push(int32_t id) {
  pending_ += tok_.token_bytes(id, /*skip_special=*/true);
  // emit everything up to the last complete UTF-8 character
  size_t n = pending_.size(), cut = n;
  size_t k = n;
  while (k > 0 && n - k < 4) {
    unsigned char c = static_cast<unsigned char>(pending_[k - 1]);
    if ((c & 0xC0) == 0x80) {  // continuation byte: keep looking for the lead
      --k;
      continue;
    }
    size_t need = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    cut = (n - (k - 1) >= need) ? n : k - 1;
    break;
  }
  std::string out = pending_.substr(0, cut);
  pending_.erase(0, cut);
  return out;
}

std::string TokenStreamer::flush() {
  std::string out;
  out.swap(pending_);
  return out;
}

}  // namespace pagedkv_rt
