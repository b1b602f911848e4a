// BPE tokenizer for HuggingFace tokenizer.json files, added tokens split out first. Two kinds:
//  - byte-level (GPT-2 / SmolLM2 / Qwen2 / Llama-3 style): ByteLevel pre-tokenizer with the GPT-2 split
//    regex, or a Split on Qwen2's / Llama 3's regex then ByteLevel; an NFC normalizer (text NFC would
//    change is refused: no NFC tables here); ByteLevel decoder; symbols are the bytes mapped to
//    printable code points;
//  - SentencePiece-style (Gemma): Replace normalizers (" " -> "\u2581"), an optional Split pre-tokenizer
//    on a string, symbols are code points, a code point missing from the vocab becomes its UTF-8 bytes'
//    <0xHH> tokens (byte_fallback), decoder Replace / ByteFallback / Fuse.
// Merges: the lowest-ranked adjacent pair first, leftmost among equals (a heap, so a long word is
// O(n log n)). Written for pagedkv; no third-party code.
// Not pytorch-tokenizers: its one PyPI release with C++ sources (1.0.1) links sentencepiece, RE2 and abseil
// and re-applies GPT-2's regex after Qwen2's Split (no use_regex) and has no byte_fallback (Gemma 3).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace pagedkv_rt {

class Json;

class Tokenizer {
 public:
  // Loads tokenizer.json; throws std::runtime_error naming what is unsupported or malformed.
  static Tokenizer from_file(const std::string& path);
  static Tokenizer from_json(const Json& j);

  // Encodes UTF-8 text. add_special applies the post-processor's template (e.g. a BOS token).
  std::vector<int32_t> encode(const std::string& text, bool add_special = true) const;
  // Decodes ids to UTF-8 bytes (invalid sequences are kept as raw bytes).
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;
  // The bytes of one token (added tokens: their content; special ones empty when skip_special).
  std::string token_bytes(int32_t id, bool skip_special = false) const;

  int32_t vocab_size() const { return static_cast<int32_t>(id_to_token_.size()); }
  int32_t token_id(const std::string& content) const;  // -1 if unknown (vocab or added token)
  bool is_special(int32_t id) const;

 private:
  struct AddedToken {
    std::string content;
    int32_t id;
    bool special;
  };
  std::unordered_map<std::string, int32_t> vocab_;  // byte-level (mapped) string -> id
  std::vector<std::string> id_to_token_;            // id -> mapped string (or added content)
  std::vector<uint8_t> id_special_;
  std::unordered_map<std::string, int32_t> merge_rank_;  // "a\x01b" -> rank
  std::vector<AddedToken> added_;                         // sorted longest content first
  std::vector<std::vector<size_t>> added_by_byte_;        // first byte -> indices into added_ (longest first)
  std::vector<int32_t> prefix_ids_, suffix_ids_;          // post-processor template specials
  bool byte_level_ = true;                                // false: SentencePiece-style (see above)
  std::vector<std::pair<std::string, std::string>> normalize_;  // Replace normalizers, in order
  std::string split_after_;                               // Split pre-tokenizer (MergedWithPrevious) string
  bool byte_fallback_ = false;
  int32_t unk_id_ = -1;
  std::vector<std::pair<std::string, std::string>> decode_replace_;  // decoder Replace steps
  enum class Split { kNone, kGpt2, kQwen2, kLlama3 };  // the byte-level pre-tokenizer's regex
  Split split_ = Split::kGpt2;
  bool nfc_ = false;  // NFC normalizer: text NFC could change is refused (require_nfc)
  bool add_prefix_space_ = false;
  bool ignore_merges_ = false;
  std::string byte_to_mapped_[256];
  std::unordered_map<uint32_t, uint8_t> mapped_to_byte_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;

  void bpe_word(const std::string& word_bytes, std::vector<int32_t>& out) const;
  void merge(std::vector<std::string>& sym) const;
  void encode_plain(const std::string& text, std::vector<int32_t>& out) const;
};

// Splits text with the GPT-2 pre-tokenizer regex
// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
std::vector<std::string> gpt2_split(const std::string& text);

// Splits text with the Llama 3 / Qwen2 Split regex (max_digits 3 / 1):
// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|
// \s*[\r\n]+|\s+(?!\S)|\s+
std::vector<std::string> llama3_split(const std::string& text, int max_digits);

// Turns a stream of token ids into text pieces that are whole UTF-8 characters.
class TokenStreamer {
 public:
  explicit TokenStreamer(const Tokenizer& tok) : tok_(tok) {}
  std::string push(int32_t id);  // the complete characters this token finishes (may be empty)
  std::string flush();           // whatever is left (possibly invalid UTF-8)

 private:
  const Tokenizer& tok_;
  std::string pending_;
};

}  // namespace pagedkv_rt
