// A small Jinja2 subset, enough to render HF chat templates (ChatML/SmolLM2, Gemma, Llama-3 style) on the
// phone without Python. Rendering matches jinja2 with the settings transformers uses (sandboxed,
// trim_blocks, lstrip_blocks); tests/test_android_native.py compares the two on real and test templates.
//
// Supported: text; {{ expr }}; {% if/elif/else/endif %}; {% for x in expr %} ... {% else %} {% endfor %}
// with loop.index/index0/first/last/length/revindex; {% set name = expr %}; {# comments #}; whitespace
// control with '-'; expressions: literals (strings, integers, true/false/none, lists, dicts), names,
// a.b, a[i], a[i:j], calls raise_exception(msg), s.strip()/lstrip()/rstrip()/startswith()/endswith()/
// upper()/lower(), d.get(k[, default]), d.items()/keys()/values(); filters trim, length, upper, lower,
// first, last, default(x), string; tests string, mapping, iterable, sequence, defined, undefined, none,
// number; operators or and not == != < > <= >= in, not in, + - * / // % ~, if-else expressions.
// Anything else is a TemplateError naming it, never a wrong rendering.
// Not minja: offline it exists only vendored in llama-cpp-python 0.3.16 (0.3.36 dropped it), needs RTTI
// and a std::regex lexer, and renders none/undefined alike where jinja2 (our reference) does not.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace pagedkv_rt {

class TemplateError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A template value: what the chat template sees (messages, strings, flags).
struct TValue {
  enum Kind { kUndefined, kNone, kBool, kInt, kStr, kList, kMap } kind = kUndefined;
  bool b = false;
  int64_t i = 0;
  std::string s;
  std::shared_ptr<std::vector<TValue>> list;
  std::shared_ptr<std::vector<std::pair<std::string, TValue>>> map;  // insertion order, like a Python dict

  static TValue none() { TValue v; v.kind = kNone; return v; }
  static TValue boolean(bool x) { TValue v; v.kind = kBool; v.b = x; return v; }
  static TValue integer(int64_t x) { TValue v; v.kind = kInt; v.i = x; return v; }
  static TValue str(std::string x) { TValue v; v.kind = kStr; v.s = std::move(x); return v; }
  static TValue new_list() { TValue v; v.kind = kList; v.list = std::make_shared<std::vector<TValue>>(); return v; }
  static TValue new_map() {
    TValue v; v.kind = kMap; v.map = std::make_shared<std::vector<std::pair<std::string, TValue>>>(); return v;
  }
  const TValue* get(const std::string& key) const;  // map lookup, nullptr if absent
  void set(const std::string& key, TValue v);       // map insert/replace
};

class ChatTemplate {
 public:
  explicit ChatTemplate(const std::string& source);  // parses; throws TemplateError
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  // Renders with these top-level variables (messages, add_generation_prompt, bos_token, ...).
  std::string render(const std::map<std::string, TValue>& vars) const;

  struct Node;

 private:
  std::vector<std::unique_ptr<Node>> body_;
};

// messages = [{"role": r, "content": c}, ...]
TValue chat_messages(const std::vector<std::pair<std::string, std::string>>& role_content);

}  // namespace pagedkv_rt
