// src/json.h over nlohmann/json: key order, repeated keys, numbers (as the old strtod reader gave them),
// strings, and hostile input (malformed, NaN, deep nesting, huge tokens): one short line each.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "json.h"
#include "test_util.h"

using namespace pagedkv_rt;

namespace {

// The message Json::parse throws for text ("" when it parses).
std::string error_of(const std::string& text) {
  try {
    Json::parse(text);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

// One printable line of bounded length that starts like every parse error.
bool one_short_line(const std::string& msg) {
  if (msg.compare(0, 12, "invalid JSON") != 0 || msg.size() > 300) return false;
  for (char c : msg)
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7F) return false;
  return true;
}

bool int_throws(const Json& j) {
  try {
    j.as_int();
  } catch (const std::runtime_error& e) {
    return std::strstr(e.what(), "does not fit a 64-bit integer") != nullptr;
  }
  return false;
}

std::string nested(size_t depth, const char* open, const char* close) {
  std::string s;
  for (size_t i = 0; i < depth; ++i) s += open;
  for (size_t i = 0; i < depth; ++i) s += close;
  return s;
}

}  // namespace

int main() {
  t::Summary s;

  s.run("objects_keep_key_order", [] {
    const Json j = Json::parse(R"({"b": 1, "a": [true, false, null], "c": {"z": "x", "y": 2}})");
    CHECK(j.is_object() && j.size() == 3);
    CHECK(j.members()[0].first == "b" && j.members()[1].first == "a" && j.members()[2].first == "c");
    CHECK(j["c"].members()[0].first == "z" && j["c"]["y"].as_int() == 2);
    CHECK(j["a"].size() == 3 && j["a"][0].as_bool() && !j["a"][1].as_bool() && j["a"][2].is_null());
    CHECK(j.has("a") && !j.has("d") && j.find("d") == nullptr && j["a"].find("x") == nullptr);
  });

  s.run("repeated_key_last_value_first_position", [] {
    const Json j = Json::parse(R"({"a": 1, "b": 2, "a": {"k": 3}})");  // Python's json.loads: {'a': {'k': 3}, 'b': 2}
    CHECK(j.size() == 2 && j.members()[0].first == "a" && j.members()[1].first == "b");
    CHECK(j["a"]["k"].as_int() == 3 && j.members()[0].second["k"].as_int() == 3);
  });

  s.run("numbers_as_strtod_gave_them", [] {
    // as_number: the literal's correctly rounded double, as the old reader's strtod; as_int: the old
    // static_cast<int64_t> where that was defined and exact
    for (const char* lit : {"0", "-0", "7", "-1", "42", "2.7", "-2.7", "0.5", "1e3", "-1.5E+2", "123456789012",
                            "9007199254740992", "-9007199254740992", "1e-400", "4.9e-324", "1.7976931348623157e308"}) {
      const Json j = Json::parse(std::string("[") + lit + "]")[0];
      const double want = std::strtod(lit, nullptr);
      CHECK(j.is_number() && j.as_number() == want);
      if (std::fabs(want) < 9.2e18) CHECK_EQ(j.as_int(), static_cast<int64_t>(want));
    }
    // beyond 2^53 an integer literal is exact in as_int (the old reader rounded it to a double first)
    const Json big = Json::parse("[9007199254740993, -9223372036854775808, 9223372036854775807]");
    CHECK_EQ(big[0].as_int(), INT64_C(9007199254740993));
    CHECK(big[0].as_number() == 9007199254740992.0);
    CHECK_EQ(big[1].as_int(), std::numeric_limits<int64_t>::min());
    CHECK_EQ(big[2].as_int(), std::numeric_limits<int64_t>::max());
    // outside int64 (the old cast was undefined): a clear error; as_number still the double
    const Json out = Json::parse("[9223372036854775808, 18446744073709551616, -1e19, 1e30, -1e300]");
    for (size_t i = 0; i < out.size(); ++i) CHECK(int_throws(out[i]));
    CHECK(out[0].as_number() == 9223372036854775808.0 && out[3].as_number() == 1e30);
    // beyond double (the old reader gave inf): malformed, as nlohmann has it
    for (const char* inf : {"[1e999]", "[-1e999]"}) {
      const std::string msg = error_of(inf);
      CHECK(one_short_line(msg) && msg.find("number overflow") != std::string::npos);
    }
  });

  s.run("strings_and_escapes", [] {
    const Json j = Json::parse(R"(["\u00e9\/\"\\\b\f\n\r\t", "\ud83d\ude00", "caf\u00C9", ")"
                               "\xc3\xa9\xe2\x82\xac" R"("])");
    CHECK(j[0].as_string() == "\xc3\xa9/\"\\\b\f\n\r\t");
    CHECK(j[1].as_string() == "\xf0\x9f\x98\x80");
    CHECK(j[2].as_string() == "caf\xc3\x89");
    CHECK(j[3].as_string() == "\xc3\xa9\xe2\x82\xac" && j[3].size() == 5);
  });

  s.run("accessor_errors_name_what_is_wrong", [] {
    const Json j = Json::parse(R"({"pool": {"num_blocks": "8"}, "l": [1]})");
    std::string msg;
    try {
      j["pool"]["block_size"];
    } catch (const std::runtime_error& e) {
      msg = e.what();
    }
    CHECK(msg == "JSON key 'block_size' is missing");
    bool type_error = false, range_error = false;
    try {
      j["pool"]["num_blocks"].as_int();
    } catch (const std::runtime_error& e) {
      type_error = std::string(e.what()) == "JSON value is not a number";
    }
    try {
      j["l"][1];
    } catch (const std::runtime_error& e) {
      range_error = std::string(e.what()) == "JSON array index 1 out of range";
    }
    CHECK(type_error && range_error);
  });

  s.run("malformed_input_says_where", [] {
    const std::string cut = error_of("{\"format_version\": 1,\n  \"pool\": ");
    std::printf("    %s\n", cut.c_str());
    CHECK(one_short_line(cut) && cut.find("at offset 32 (line 2, column 11)") != std::string::npos);
    const std::string colon = error_of("{\"a\" 1}");
    std::printf("    %s\n", colon.c_str());
    CHECK(one_short_line(colon) && colon.find("at offset 5 ") != std::string::npos);
    for (const char* bad : {"", " ", "{", "[1,]", "{\"a\":1,}", "{a: 1}", "[01]", "[1.]", "[-]", "[.5]", "[0x10]",
                            "[NaN]", "{\"format_version\": NaN}", "[Infinity]", "[-Infinity]", "[-inf]", "[nul]",
                            "[1] x", "[1][2]", "'a'", "[\"\\ud800\"]", "[\"\\udc00x\"]", "[\"\\q\"]", "[\"\\u12\"]",
                            "[\"a\nb\"]", "[\"\xff\"]", "[\"\xc3\"]", "[\"\xed\xa0\x80\"]", "\"unterminated"}) {
      const std::string msg = error_of(bad);
      if (!one_short_line(msg)) std::printf("    input %s: '%s'\n", bad, msg.c_str());
      CHECK(one_short_line(msg));
    }
    // a huge token in the message (nlohmann's "last read") is cut short
    const std::string huge = error_of("[\"" + std::string(1 << 20, 'x') + "\\q\"]");
    CHECK(one_short_line(huge) && huge.find("...") != std::string::npos);
  });

  s.run("nesting_is_bounded", [] {
    CHECK(Json::parse(nested(256, "[", "]")).is_array());
    std::string obj;
    for (int i = 0; i < 256; ++i) obj += "{\"a\":";
    obj += "1" + std::string(256, '}');
    CHECK(Json::parse(obj).is_object());
    for (const std::string& deep : {nested(257, "[", "]"), nested(100000, "[", "]"), std::string(100000, '['),
                                    nested(100000, "{\"a\":", "}"), "[" + nested(300, "{\"k\":[", "]}") + "]"}) {
      const std::string msg = error_of(deep);
      CHECK(one_short_line(msg) && msg.find("nested deeper than 256") != std::string::npos);
    }
  });

  s.run("large_object_parses_in_linear_time", [] {
    // a tokenizer.json's vocab: 200k keys (ordered_json's linear key search would take minutes here)
    std::string text = "{\"model\": {\"vocab\": {";
    for (int i = 0; i < 200000; ++i) text += (i ? ",\"t" : "\"t") + std::to_string(i) + "\": " + std::to_string(i);
    text += "}}}";
    const Json j = Json::parse(text);
    const Json& v = j["model"]["vocab"];
    CHECK(v.size() == 200000 && v.members()[199999].first == "t199999" && v["t12345"].as_int() == 12345);
  });

  s.run("utf8_lossy_replaces_as_python_does", [] {
    // expected: bytes.decode("utf-8", errors="replace") (one U+FFFD per maximal invalid prefix)
    const std::string R = "\xEF\xBF\xBD";
    const std::pair<std::string, std::string> cases[] = {
        {"ab", "ab"},
        {"\xE2\x82\xAC", "\xE2\x82\xAC"},             // the euro sign
        {"\xE2\x82", R},                                // truncated
        {"\xE2\x82x", R + "x"},                         // broken
        {"\xC0\xAF", R + R},                            // overlong
        {"\xED\xA0\x80", R + R + R},                     // a surrogate
        {"\xF4\x90\x80\x80", R + R + R + R},              // above U+10FFFF
        {"\xF0\x9F\x98", R},                            // an emoji cut short (a byte token mid-character)
        {"\xF0\x9F\x98\x80", "\xF0\x9F\x98\x80"},
        {"\x80\x80", R + R},
        {"\xE0\x9F\x80", R + R + R},
        {R, R},
        {"\xFF", R},
    };
    for (const auto& [in, want] : cases) {
      CHECK(utf8_lossy(in) == want);
      CHECK(Json::parse("\"" + utf8_lossy(in) + "\"").as_string() == want);  // what a conversation file stores
    }
  });

  return s.finish();
}
