#include "json.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <stdexcept>

#include <nlohmann/json.hpp>

static_assert(NLOHMANN_JSON_VERSION_MAJOR == 3 && NLOHMANN_JSON_VERSION_MINOR >= 11,
              "json.cpp uses nlohmann/json 3.11+'s detail::parser (see JsonParser::run)");

namespace pagedkv_rt {

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

size_t next_utf8(const std::string& s, size_t i, uint32_t* cp) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  // the well-formed sequences (Unicode table 3-7): the length and the range of the second byte by the
  // lead byte; overlong forms, surrogates and code points above U+10FFFF have no valid lead/second pair
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    lo = c == 0xE0 ? 0xA0 : 0x80;
    hi = c == 0xED ? 0x9F : 0xBF;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    lo = c == 0xF0 ? 0x90 : 0x80;
    hi = c == 0xF4 ? 0x8F : 0xBF;
  }
  *cp = 0xFFFD;
  if (n == 0) return 1;
  uint32_t v = c & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) {
    if (i + k >= s.size()) return k;  // truncated: the valid prefix is one U+FFFD
    const unsigned char cc = static_cast<unsigned char>(s[i + k]);
    if (cc < (k == 1 ? lo : 0x80) || cc > (k == 1 ? hi : 0xBF)) return k;
    v = (v << 6) | (cc & 0x3F);
  }
  *cp = v;
  return n;
}

std::string utf8_lossy(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    i += next_utf8(s, i, &cp);
    append_utf8(out, cp);
  }
  return out;
}

namespace {
constexpr size_t kMaxDepth = 256;  // nested arrays/objects; deeper input is refused (hostile files)
constexpr size_t kMaxDetail = 160;  // bytes of nlohmann's message kept (its "last read" can be a whole string)

// nlohmann's message without its "[json.exception.parse_error.101] parse error at line L, column C: "
// prefix (the position is said in front), cut short and printable: one line for any input.
std::string parse_error_detail(const std::string& what) {
  std::string d = what;
  if (size_t p = d.find("] "); p != std::string::npos) d.erase(0, p + 2);
  if (d.compare(0, 11, "parse error") == 0)
    if (size_t p = d.find(": "); p != std::string::npos) d.erase(0, p + 2);
  if (d.size() > kMaxDetail) d = d.substr(0, kMaxDetail) + "...";
  for (char& c : d)
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7F) c = '?';
  return d;
}
}  // namespace

// Builds the Json tree from the SAX events of nlohmann's parser. Not through an nlohmann::ordered_json
// DOM: ordered_json's object is a vector searched linearly on every insert, so a tokenizer.json vocab of
// 150k keys parses in quadratic time (40k keys: 3.5 s; nlohmann::json's std::map, which loses the order:
// 0.02 s), and the events build the one tree directly. nlohmann's parser is iterative; the depth limit
// here bounds the recursion of the code that walks the tree afterwards (json_same, to_value, destructors).
class JsonParser final : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit JsonParser(const std::string& text) : text_(text) {}

  // nlohmann's JSON parser itself (what json::sax_parse runs for input_format_t::json): sax_parse's
  // runtime switch on the format would also compile the CBOR/MessagePack/UBJSON/BSON readers for this
  // handler: 79 KB more in the stripped aarch64 libpagedkv_runner.so. (3.12 only adds a defaulted argument.)
  Json run() {
    auto in = nlohmann::detail::input_adapter(text_.data(), text_.data() + text_.size());
    nlohmann::detail::parser<nlohmann::json, decltype(in)> parser(std::move(in), nullptr, /*allow_exceptions=*/true,
                                                                  /*skip_comments=*/false);
    if (!parser.sax_parse(this, /*strict=*/true)) throw std::runtime_error(error_);
    return std::move(root_);
  }

  bool null() override { return put(Json()); }
  bool boolean(bool v) override {
    Json j;
    j.type_ = Json::Type::kBool;
    j.b_ = v;
    return put(std::move(j));
  }
  bool number_integer(number_integer_t v) override { return put(integer(v, static_cast<double>(v), true)); }
  bool number_unsigned(number_unsigned_t v) override {
    const bool fits = v <= static_cast<number_unsigned_t>(INT64_MAX);
    return put(integer(fits ? static_cast<int64_t>(v) : 0, static_cast<double>(v), fits));
  }
  bool number_float(number_float_t v, const string_t&) override { return put(integer(0, v, false)); }
  bool string(string_t& v) override {
    Json j;
    j.type_ = Json::Type::kString;
    j.str_ = v;  // a copy: the lexer keeps its buffer's capacity (moving it out measured slower)
    return put(std::move(j));
  }
  bool binary(binary_t&) override { return false; }  // not produced by the JSON parser
  bool start_object(size_t) override {
    Json j;
    j.type_ = Json::Type::kObject;
    j.index_ = std::make_shared<std::map<std::string, size_t>>();
    return open(std::move(j));
  }
  bool key(string_t& k) override {
    key_ = k;
    return true;
  }
  bool end_object() override { return close(); }
  bool start_array(size_t) override {
    Json j;
    j.type_ = Json::Type::kArray;
    return open(std::move(j));
  }
  bool end_array() override { return close(); }
  bool parse_error(size_t position, const std::string&, const nlohmann::detail::exception& ex) override {
    // position: the bytes read, the offending one included; line and column (1-based) counted here
    const size_t at = position > 0 ? std::min(position - 1, text_.size()) : 0;
    size_t line = 1, col = 1;
    for (size_t k = 0; k < at; ++k) {
      if (text_[k] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    error_ = "invalid JSON at offset " + std::to_string(at) + " (line " + std::to_string(line) + ", column " +
             std::to_string(col) + "): " + parse_error_detail(ex.what());
    return false;
  }

 private:
  const std::string& text_;
  Json root_;
  std::vector<Json*> stack_;  // the open arrays/objects; a parent's vector grows only after its child closed
  std::string key_;
  std::string error_;

  static Json integer(int64_t i, double d, bool exact) {
    Json j;
    j.type_ = Json::Type::kNumber;
    j.num_ = d;
    j.int_exact_ = exact;
    j.int_ = i;
    return j;
  }
  // Stores v in the open array/object (or as the root) and returns where it went.
  Json* place(Json&& v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Json& top = *stack_.back();
    if (top.type_ == Json::Type::kArray) {
      top.arr_.push_back(std::move(v));
      return &top.arr_.back();
    }
    auto [it, fresh] = top.index_->emplace(key_, top.obj_.size());
    if (!fresh) {  // a repeated key: the last value wins, at the first position
      top.obj_[it->second].second = std::move(v);
      return &top.obj_[it->second].second;
    }
    top.obj_.emplace_back(std::move(key_), std::move(v));
    return &top.obj_.back().second;
  }
  bool put(Json&& v) {
    place(std::move(v));
    return true;
  }
  bool open(Json&& v) {
    if (stack_.size() >= kMaxDepth) {
      error_ = "invalid JSON: nested deeper than " + std::to_string(kMaxDepth) + " arrays/objects";
      return false;
    }
    stack_.push_back(place(std::move(v)));
    return true;
  }
  bool close() {
    stack_.pop_back();
    return true;
  }
};

Json Json::parse(const std::string& text) { return JsonParser(text).run(); }

static std::runtime_error type_error(const char* want) {
  return std::runtime_error(std::string("JSON value is not ") + want);
}

bool Json::as_bool() const {
  if (type_ != Type::kBool) throw type_error("a boolean");
  return b_;
}
double Json::as_number() const {
  if (type_ != Type::kNumber) throw type_error("a number");
  return num_;
}
int64_t Json::as_int() const {
  const double v = as_number();
  if (int_exact_) return int_;
  // a fraction truncates toward zero; outside int64 (where the cast would be undefined) is an error
  if (!(v >= -9223372036854775808.0 && v < 9223372036854775808.0)) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    throw std::runtime_error(std::string("JSON number ") + buf + " does not fit a 64-bit integer");
  }
  return static_cast<int64_t>(v);
}
const std::string& Json::as_string() const {
  if (type_ != Type::kString) throw type_error("a string");
  return str_;
}
const std::vector<Json>& Json::items() const {
  if (type_ != Type::kArray) throw type_error("an array");
  return arr_;
}
const std::vector<std::pair<std::string, Json>>& Json::members() const {
  if (type_ != Type::kObject) throw type_error("an object");
  return obj_;
}
const Json* Json::find(const std::string& key) const {
  if (type_ != Type::kObject) return nullptr;
  auto it = index_->find(key);
  return it == index_->end() ? nullptr : &obj_[it->second].second;
}
bool Json::has(const std::string& key) const { return find(key) != nullptr; }
const Json& Json::operator[](const std::string& key) const {
  const Json* v = find(key);
  if (!v) throw std::runtime_error("JSON key '" + key + "' is missing");
  return *v;
}
const Json& Json::operator[](size_t i) const {
  const auto& a = items();
  if (i >= a.size()) throw std::runtime_error("JSON array index " + std::to_string(i) + " out of range");
  return a[i];
}
size_t Json::size() const {
  if (type_ == Type::kArray) return arr_.size();
  if (type_ == Type::kObject) return obj_.size();
  if (type_ == Type::kString) return str_.size();
  return 0;
}

}  // namespace pagedkv_rt
