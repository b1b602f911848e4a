#include "json.h"

#include <cstdlib>
#include <stdexcept>

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
  const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (n == 0 || i + n > s.size()) {
    *cp = 0xFFFD;
    return 1;
  }
  uint32_t v = n == 1 ? c : c & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) {
    const unsigned char cc = static_cast<unsigned char>(s[i + k]);
    if ((cc & 0xC0) != 0x80) {
      *cp = 0xFFFD;
      return 1;
    }
    v = (v << 6) | (cc & 0x3F);
  }
  *cp = v;
  return n;
}

class JsonParser {
 public:
  explicit JsonParser(const std::string& s) : s_(s) {}

  Json run() {
    Json v = value(0);
    ws();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  const std::string& s_;
  size_t i_ = 0;

  [[noreturn]] void fail(const char* what) {
    throw std::runtime_error(std::string("invalid JSON: ") + what + " at offset " + std::to_string(i_));
  }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  bool lit(const char* w) {
    size_t n = 0;
    while (w[n]) ++n;
    if (s_.compare(i_, n, w) == 0) {
      i_ += n;
      return true;
    }
    return false;
  }
  uint32_t hex4() {
    if (i_ + 4 > s_.size()) fail("short \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      char c = s_[i_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= c - '0';
      else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
      else fail("bad hex digit in \\u escape");
    }
    return v;
  }
  std::string string() {
    if (s_[i_] != '"') fail("expected a string");
    ++i_;
    std::string out;
    for (;;) {
      if (i_ >= s_.size()) fail("unterminated string");
      char c = s_[i_++];
      if (c == '"') return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unterminated escape");
      char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00 && i_ + 6 <= s_.size() && s_[i_] == '\\' && s_[i_ + 1] == 'u') {
            size_t save = i_;
            i_ += 2;
            uint32_t lo = hex4();
            if (lo >= 0xDC00 && lo < 0xE000) cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            else i_ = save;
          }
          append_utf8(out, cp);
          break;
        }
        default: fail("bad escape");
      }
    }
  }
  Json value(int depth) {
    if (depth > 256) fail("nesting too deep");
    ws();
    if (i_ >= s_.size()) fail("unexpected end");
    Json v;
    char c = s_[i_];
    if (c == '{') {
      ++i_;
      v.type_ = Json::Type::kObject;
      v.index_ = std::make_shared<std::map<std::string, size_t>>();
      ws();
      if (i_ < s_.size() && s_[i_] == '}') {
        ++i_;
        return v;
      }
      for (;;) {
        ws();
        std::string key = string();
        ws();
        if (i_ >= s_.size() || s_[i_] != ':') fail("expected ':'");
        ++i_;
        Json member = value(depth + 1);
        (*v.index_)[key] = v.obj_.size();
        v.obj_.emplace_back(std::move(key), std::move(member));
        ws();
        if (i_ < s_.size() && s_[i_] == ',') { ++i_; continue; }
        if (i_ < s_.size() && s_[i_] == '}') { ++i_; return v; }
        fail("expected ',' or '}'");
      }
    }
    if (c == '[') {
      ++i_;
      v.type_ = Json::Type::kArray;
      ws();
      if (i_ < s_.size() && s_[i_] == ']') {
        ++i_;
        return v;
      }
      for (;;) {
        v.arr_.push_back(value(depth + 1));
        ws();
        if (i_ < s_.size() && s_[i_] == ',') { ++i_; continue; }
        if (i_ < s_.size() && s_[i_] == ']') { ++i_; return v; }
        fail("expected ',' or ']'");
      }
    }
    if (c == '"') {
      v.type_ = Json::Type::kString;
      v.str_ = string();
      return v;
    }
    if (lit("true")) { v.type_ = Json::Type::kBool; v.b_ = true; return v; }
    if (lit("false")) { v.type_ = Json::Type::kBool; v.b_ = false; return v; }
    if (lit("null")) return v;
    if (c == '-' || (c >= '0' && c <= '9')) {
      const char* start = s_.c_str() + i_;
      char* end = nullptr;
      v.num_ = std::strtod(start, &end);
      if (end == start) fail("bad number");
      i_ += static_cast<size_t>(end - start);
      v.type_ = Json::Type::kNumber;
      return v;
    }
    fail("unexpected character");
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
int64_t Json::as_int() const { return static_cast<int64_t>(as_number()); }
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
