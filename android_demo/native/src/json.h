// An accessor layer over nlohmann/json: Json::parse runs nlohmann's parser (RFC 8259, strict) and keeps an
// immutable tree whose lookups throw messages naming the missing key; objects keep key order.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace pagedkv_rt {

class Json {
 public:
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };

  // Parses text; throws std::runtime_error("invalid JSON at offset N (line L, column C): ...") on malformed
  // input, and on nesting deeper than 256 arrays/objects. A key given twice: the last value wins, at the
  // key's first position (as Python's json.loads).
  static Json parse(const std::string& text);

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::kNull; }
  bool is_object() const { return type_ == Type::kObject; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_number() const { return type_ == Type::kNumber; }

  bool as_bool() const;
  double as_number() const;  // the literal as a double (correctly rounded)
  // An integer literal exactly (within int64), a fraction truncated toward zero; throws for a value
  // outside int64 (2^63, 1e30). A literal beyond double (1e999) does not parse.
  int64_t as_int() const;
  const std::string& as_string() const;
  const std::vector<Json>& items() const;                            // array
  const std::vector<std::pair<std::string, Json>>& members() const;  // object, in order

  bool has(const std::string& key) const;
  const Json& operator[](const std::string& key) const;  // throws if missing (message names the key)
  const Json& operator[](size_t i) const;
  const Json* find(const std::string& key) const;  // nullptr if missing or not an object
  size_t size() const;

 private:
  friend class JsonParser;
  Type type_ = Type::kNull;
  bool b_ = false;
  bool int_exact_ = false;  // an integer literal that fits int64: int_ holds it
  double num_ = 0;
  int64_t int_ = 0;
  std::string str_;
  std::vector<Json> arr_;
  std::vector<std::pair<std::string, Json>> obj_;
  std::shared_ptr<std::map<std::string, size_t>> index_;  // key -> position in obj_
};

// Appends the UTF-8 encoding of code point cp.
void append_utf8(std::string& out, uint32_t cp);

// Decodes the code point starting at byte i of s into *cp and returns its byte length. Bytes that are
// not well-formed UTF-8 (a bad lead byte, an overlong form, a surrogate, a truncated or broken
// sequence) decode as U+FFFD, one for each maximal invalid prefix, as Python's errors="replace" and
// Rust's from_utf8_lossy (HF tokenizers' decode) do.
size_t next_utf8(const std::string& s, size_t i, uint32_t* cp);

// s with every invalid sequence replaced by U+FFFD (next_utf8): text that JSON parsers accept.
std::string utf8_lossy(const std::string& s);

}  // namespace pagedkv_rt
