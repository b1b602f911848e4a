// A small Jinja2 subset for chat templates; see chat_template.h for what it covers.
#include "chat_template.h"

#include <algorithm>
#include <cctype>
#include <functional>

namespace pagedkv_rt {

const TValue* TValue::get(const std::string& key) const {
  if (kind != kMap) return nullptr;
  for (const auto& kv : *map)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

void TValue::set(const std::string& key, TValue v) {
  for (auto& kv : *map)
    if (kv.first == key) {
      kv.second = std::move(v);
      return;
    }
  map->emplace_back(key, std::move(v));
}

TValue chat_messages(const std::vector<std::pair<std::string, std::string>>& role_content) {
  TValue list = TValue::new_list();
  for (const auto& rc : role_content) {
    TValue m = TValue::new_map();
    m.set("role", TValue::str(rc.first));
    m.set("content", TValue::str(rc.second));
    list.list->push_back(m);
  }
  return list;
}

namespace {

[[noreturn]] void fail(const std::string& msg) { throw TemplateError("chat template: " + msg); }

// ---- expressions ------------------------------------------------------------------------------------

struct Tok {
  enum Kind { kName, kInt, kStr, kOp, kEnd } kind;
  std::string text;
  int64_t num = 0;
};

std::vector<Tok> lex_expr(const std::string& s) {
  std::vector<Tok> out;
  size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++i;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      out.push_back({Tok::kName, s.substr(i, j - i)});
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
      if (j < s.size() && s[j] == '.') fail("floating point literals are not supported");
      Tok t{Tok::kInt, s.substr(i, j - i)};
      t.num = std::stoll(t.text);
      out.push_back(t);
      i = j;
    } else if (c == '\'' || c == '"') {
      std::string v;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != c; ++j) {
        if (s[j] == '\\' && j + 1 < s.size()) {
          const char e = s[++j];
          v += e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e;
        } else {
          v += s[j];
        }
      }
      if (j >= s.size()) fail("unterminated string literal");
      out.push_back({Tok::kStr, v});
      i = j + 1;
    } else {
      static const char* two[] = {"==", "!=", "<=", ">=", "//", "**"};
      std::string op(1, c);
      for (const char* t : two)
        if (s.compare(i, 2, t) == 0) op = t;
      if (op.size() == 1 && std::string("()[]{},.:|~+-*/%<>=").find(c) == std::string::npos)
        fail(std::string("unexpected '") + c + "'");
      out.push_back({Tok::kOp, op});
      i += op.size();
    }
  }
  out.push_back({Tok::kEnd, ""});
  return out;
}

struct Expr {
  enum Kind { kLit, kName, kList, kDict, kAttr, kIndex, kSlice, kCall, kFilter, kTest, kUnary, kBinary, kCond } kind;
  std::string op;  // name / attribute / operator / filter / test
  TValue lit;
  std::vector<std::unique_ptr<Expr>> a;  // children (kSlice: obj, start|null, stop|null)
  bool neg = false;                      // kTest: 'is not'
};
using ExprP = std::unique_ptr<Expr>;

ExprP mk(Expr::Kind k, std::string op = "") {
  auto e = std::make_unique<Expr>();
  e->kind = k;
  e->op = std::move(op);
  return e;
}

class ExprParser {
 public:
  explicit ExprParser(std::vector<Tok> t) : t_(std::move(t)) {}
  ExprP parse_all() {
    ExprP e = expr();
    if (t_[p_].kind != Tok::kEnd) fail("unexpected '" + t_[p_].text + "' in an expression");
    return e;
  }
  ExprP expr() {
    ExprP e = or_expr();
    if (is_name("if")) {
      ++p_;
      auto c = mk(Expr::kCond);
      ExprP cond = or_expr();
      ExprP other = is_name("else") ? (++p_, expr()) : nullptr;
      c->a.push_back(std::move(e));
      c->a.push_back(std::move(cond));
      c->a.push_back(std::move(other));
      return c;
    }
    return e;
  }
  bool is_name(const char* n) const { return t_[p_].kind == Tok::kName && t_[p_].text == n; }
  bool is_op(const char* o) const { return t_[p_].kind == Tok::kOp && t_[p_].text == o; }
  void want_op(const char* o) {
    if (!is_op(o)) fail(std::string("expected '") + o + "', found '" + t_[p_].text + "'");
    ++p_;
  }
  std::string want_name() {
    if (t_[p_].kind != Tok::kName) fail("expected a name, found '" + t_[p_].text + "'");
    return t_[p_++].text;
  }
  size_t pos() const { return p_; }
  const Tok& tok() const { return t_[p_]; }
  void skip() { ++p_; }

 private:
  ExprP bin(const std::string& op, ExprP l, ExprP r) {
    auto e = mk(Expr::kBinary, op);
    e->a.push_back(std::move(l));
    e->a.push_back(std::move(r));
    return e;
  }
  ExprP or_expr() {
    ExprP e = and_expr();
    while (is_name("or")) { ++p_; e = bin("or", std::move(e), and_expr()); }
    return e;
  }
  ExprP and_expr() {
    ExprP e = not_expr();
    while (is_name("and")) { ++p_; e = bin("and", std::move(e), not_expr()); }
    return e;
  }
  ExprP not_expr() {
    if (is_name("not")) {
      ++p_;
      auto e = mk(Expr::kUnary, "not");
      e->a.push_back(not_expr());
      return e;
    }
    return compare();
  }
  ExprP compare() {
    ExprP e = math1();
    while (true) {
      if (is_op("==") || is_op("!=") || is_op("<") || is_op(">") || is_op("<=") || is_op(">=")) {
        std::string op = t_[p_++].text;
        e = bin(op, std::move(e), math1());
      } else if (is_name("in")) {
        ++p_;
        e = bin("in", std::move(e), math1());
      } else if (is_name("not") && t_[p_ + 1].kind == Tok::kName && t_[p_ + 1].text == "in") {
        p_ += 2;
        e = bin("not in", std::move(e), math1());
      } else {
        return e;
      }
    }
  }
  ExprP math1() {
    ExprP e = concat();
    while (is_op("+") || is_op("-")) {
      std::string op = t_[p_++].text;
      e = bin(op, std::move(e), concat());
    }
    return e;
  }
  ExprP concat() {
    ExprP e = math2();
    while (is_op("~")) { ++p_; e = bin("~", std::move(e), math2()); }
    return e;
  }
  ExprP math2() {
    ExprP e = unary();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = t_[p_++].text;
      e = bin(op, std::move(e), unary());
    }
    return e;
  }
  ExprP unary() {
    if (is_op("-")) {
      ++p_;
      auto e = mk(Expr::kUnary, "-");
      e->a.push_back(unary());
      return filters(std::move(e));
    }
    return filters(postfix(primary()));
  }
  ExprP primary() {
    const Tok t = t_[p_];
    if (t.kind == Tok::kStr) {
      ++p_;
      std::string s = t.text;
      while (t_[p_].kind == Tok::kStr) s += t_[p_++].text;  // adjacent literals join, as in Python
      auto e = mk(Expr::kLit);
      e->lit = TValue::str(s);
      return e;
    }
    if (t.kind == Tok::kInt) {
      ++p_;
      auto e = mk(Expr::kLit);
      e->lit = TValue::integer(t.num);
      return e;
    }
    if (t.kind == Tok::kName) {
      ++p_;
      auto e = mk(Expr::kLit);
      if (t.text == "true" || t.text == "True") e->lit = TValue::boolean(true);
      else if (t.text == "false" || t.text == "False") e->lit = TValue::boolean(false);
      else if (t.text == "none" || t.text == "None") e->lit = TValue::none();
      else return mk(Expr::kName, t.text);
      return e;
    }
    if (is_op("(")) {
      ++p_;
      ExprP e = expr();
      want_op(")");
      return e;
    }
    if (is_op("[")) {
      ++p_;
      auto e = mk(Expr::kList);
      while (!is_op("]")) {
        e->a.push_back(expr());
        if (!is_op("]")) want_op(",");
      }
      ++p_;
      return e;
    }
    if (is_op("{")) {
      ++p_;
      auto e = mk(Expr::kDict);
      while (!is_op("}")) {
        e->a.push_back(expr());
        want_op(":");
        e->a.push_back(expr());
        if (!is_op("}")) want_op(",");
      }
      ++p_;
      return e;
    }
    fail("unexpected '" + t.text + "' in an expression");
  }
  void args(Expr& call) {
    want_op("(");
    while (!is_op(")")) {
      if (t_[p_].kind == Tok::kName && t_[p_ + 1].kind == Tok::kOp && t_[p_ + 1].text == "=")
        fail("keyword arguments are not supported");
      call.a.push_back(expr());
      if (!is_op(")")) want_op(",");
    }
    ++p_;
  }
  ExprP postfix(ExprP e) {
    while (true) {
      if (is_op(".")) {
        ++p_;
        auto g = mk(Expr::kAttr, want_name());
        g->a.push_back(std::move(e));
        e = std::move(g);
      } else if (is_op("[")) {
        ++p_;
        ExprP start = is_op(":") ? nullptr : expr();
        if (is_op(":")) {
          ++p_;
          ExprP stop = is_op("]") ? nullptr : expr();
          auto s = mk(Expr::kSlice);
          s->a.push_back(std::move(e));
          s->a.push_back(std::move(start));
          s->a.push_back(std::move(stop));
          e = std::move(s);
        } else {
          auto g = mk(Expr::kIndex);
          g->a.push_back(std::move(e));
          g->a.push_back(std::move(start));
          e = std::move(g);
        }
        want_op("]");
      } else if (is_op("(")) {
        auto c = mk(Expr::kCall);
        c->a.push_back(std::move(e));
        args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }
  ExprP filters(ExprP e) {
    while (true) {
      if (is_op("|")) {
        ++p_;
        auto f = mk(Expr::kFilter, want_name());
        f->a.push_back(std::move(e));
        if (is_op("(")) args(*f);
        e = std::move(f);
      } else if (is_name("is")) {
        ++p_;
        auto f = mk(Expr::kTest);
        if (is_name("not")) { ++p_; f->neg = true; }
        f->op = want_name();
        f->a.push_back(std::move(e));
        e = std::move(f);
      } else {
        return e;
      }
    }
  }
  std::vector<Tok> t_;
  size_t p_ = 0;
};

// ---- values -------------------------------------------------------------------------------------

bool truthy(const TValue& v) {
  switch (v.kind) {
    case TValue::kUndefined: case TValue::kNone: return false;
    case TValue::kBool: return v.b;
    case TValue::kInt: return v.i != 0;
    case TValue::kStr: return !v.s.empty();
    case TValue::kList: return !v.list->empty();
    case TValue::kMap: return !v.map->empty();
  }
  return false;
}

const char* kind_name(const TValue& v) {
  static const char* n[] = {"undefined", "none", "bool", "int", "string", "list", "dict"};
  return n[v.kind];
}

std::string to_str(const TValue& v) {
  switch (v.kind) {
    case TValue::kUndefined: return "";
    case TValue::kNone: return "None";
    case TValue::kBool: return v.b ? "True" : "False";
    case TValue::kInt: return std::to_string(v.i);
    case TValue::kStr: return v.s;
    default: fail(std::string("printing a ") + kind_name(v) + " is not supported");
  }
}

bool equal(const TValue& x, const TValue& y) {
  const bool xn = x.kind == TValue::kInt || x.kind == TValue::kBool, yn = y.kind == TValue::kInt || y.kind == TValue::kBool;
  if (xn && yn) return (x.kind == TValue::kInt ? x.i : x.b) == (y.kind == TValue::kInt ? y.i : y.b);
  if (x.kind != y.kind) return false;
  switch (x.kind) {
    case TValue::kUndefined: case TValue::kNone: return true;
    case TValue::kStr: return x.s == y.s;
    case TValue::kList:
      if (x.list->size() != y.list->size()) return false;
      for (size_t i = 0; i < x.list->size(); ++i)
        if (!equal((*x.list)[i], (*y.list)[i])) return false;
      return true;
    case TValue::kMap:
      if (x.map->size() != y.map->size()) return false;
      for (const auto& kv : *x.map) {
        const TValue* o = y.get(kv.first);
        if (!o || !equal(kv.second, *o)) return false;
      }
      return true;
    default: return false;
  }
}

int64_t as_int(const TValue& v, const char* what) {
  if (v.kind == TValue::kInt) return v.i;
  if (v.kind == TValue::kBool) return v.b;
  fail(std::string(what) + " needs an integer, not a " + kind_name(v));
}

std::string strip(const std::string& s, bool left, bool right, const std::string& chars = " \t\n\r\f\v") {
  size_t a = 0, b = s.size();
  if (left) while (a < b && chars.find(s[a]) != std::string::npos) ++a;
  if (right) while (b > a && chars.find(s[b - 1]) != std::string::npos) --b;
  return s.substr(a, b - a);
}

// Python-style slice bounds
void slice_bounds(int64_t n, const TValue* start, const TValue* stop, int64_t& a, int64_t& b) {
  a = start ? as_int(*start, "a slice") : 0;
  b = stop ? as_int(*stop, "a slice") : n;
  if (a < 0) a = std::max<int64_t>(0, a + n);
  if (b < 0) b = std::max<int64_t>(0, b + n);
  a = std::min(a, n);
  b = std::min(b, n);
  if (b < a) b = a;
}

size_t utf8_len(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

}  // namespace

// ---- template nodes -------------------------------------------------------------------------------

struct ChatTemplate::Node {
  enum Kind { kText, kOut, kIf, kFor, kSet } kind;
  std::string text;                             // kText; kFor: loop variable(s) "a" or "a,b"; kSet: name
  std::vector<ExprP> exprs;                     // kOut: 1; kIf: one per branch (null = else); kFor: iterable; kSet: value
  std::vector<std::vector<std::unique_ptr<Node>>> bodies;  // kIf: per branch; kFor: body, else
};

namespace {

using Body = std::vector<std::unique_ptr<ChatTemplate::Node>>;
using Node = ChatTemplate::Node;

struct RawTag {
  enum Kind { kText, kVar, kBlock } kind;
  std::string text;
};

// Splits the source into text and tags, applying '-' whitespace control, trim_blocks and lstrip_blocks
// the way jinja2 does with those two options on.
std::vector<RawTag> split(const std::string& src) {
  std::vector<RawTag> out;
  size_t i = 0;
  bool strip_next = false;      // the previous tag ended with '-'
  while (i <= src.size()) {
    size_t open = src.find('{', i);
    while (open != std::string::npos && open + 1 < src.size() && src[open + 1] != '{' && src[open + 1] != '%' &&
           src[open + 1] != '#')
      open = src.find('{', open + 1);
    if (open + 1 >= src.size()) open = std::string::npos;
    std::string text = src.substr(i, open == std::string::npos ? std::string::npos : open - i);
    const bool line_start = i == 0 || src[i - 1] == '\n';
    if (strip_next) text = strip(text, true, false);
    if (open == std::string::npos) {
      if (!text.empty()) out.push_back({RawTag::kText, text});
      break;
    }
    const char type = src[open + 1];
    const bool minus_l = open + 2 < src.size() && src[open + 2] == '-';
    const bool plus_l = open + 2 < src.size() && src[open + 2] == '+';
    if (minus_l) {
      text = strip(text, false, true);
    } else if (type != '{' && !plus_l) {  // lstrip_blocks: blanks between the line start and a block tag
      const size_t nl = text.rfind('\n');
      const size_t from = nl == std::string::npos ? 0 : nl + 1;
      if ((nl != std::string::npos || line_start) &&
          text.find_first_not_of(" \t", from) == std::string::npos)
        text.erase(from);
    }
    if (!text.empty()) out.push_back({RawTag::kText, text});
    const std::string close = type == '{' ? "}}" : type == '%' ? "%}" : "#}";
    size_t j = open + 2 + ((minus_l || plus_l) ? 1 : 0);
    size_t end = std::string::npos;
    if (type == '#') {
      end = src.find(close, j);
    } else {
      char quote = 0;
      for (size_t k = j; k + 1 < src.size(); ++k) {
        if (quote) {
          if (src[k] == '\\') ++k;
          else if (src[k] == quote) quote = 0;
        } else if (src[k] == '\'' || src[k] == '"') {
          quote = src[k];
        } else if (src.compare(k, 2, close) == 0) {
          end = k;
          break;
        }
      }
    }
    if (end == std::string::npos) fail("a tag is not closed (missing '" + close + "')");
    const bool minus_r = end > j && src[end - 1] == '-';
    std::string inner = src.substr(j, (minus_r ? end - 1 : end) - j);
    i = end + 2;
    strip_next = minus_r;
    if (!minus_r && type != '{' && i < src.size() && src[i] == '\n') ++i;  // trim_blocks
    if (type == '{') out.push_back({RawTag::kVar, inner});
    else if (type == '%') out.push_back({RawTag::kBlock, strip(inner, true, true)});
  }
  return out;
}

class BodyParser {
 public:
  explicit BodyParser(std::vector<RawTag> t) : t_(std::move(t)) {}

  // Parses until one of `ends` (a block tag's first word); returns that word ("" at the end of input).
  std::string parse(Body& body, const std::vector<std::string>& ends) {
    while (p_ < t_.size()) {
      const RawTag& t = t_[p_++];
      if (t.kind == RawTag::kText) {
        auto n = std::make_unique<Node>();
        n->kind = Node::kText;
        n->text = t.text;
        body.push_back(std::move(n));
        continue;
      }
      if (t.kind == RawTag::kVar) {
        auto n = std::make_unique<Node>();
        n->kind = Node::kOut;
        n->exprs.push_back(ExprParser(lex_expr(t.text)).parse_all());
        body.push_back(std::move(n));
        continue;
      }
      const size_t sp = t.text.find_first_of(" \t\n");
      const std::string word = t.text.substr(0, sp);
      const std::string rest = sp == std::string::npos ? "" : t.text.substr(sp + 1);
      if (std::find(ends.begin(), ends.end(), word) != ends.end()) {
        last_rest_ = rest;
        return word;
      }
      if (word == "if") {
        auto n = std::make_unique<Node>();
        n->kind = Node::kIf;
        std::string cond = rest;
        while (true) {
          n->exprs.push_back(cond.empty() ? nullptr : ExprParser(lex_expr(cond)).parse_all());
          n->bodies.emplace_back();
          const std::string w = parse(n->bodies.back(), {"elif", "else", "endif"});
          if (w == "endif") break;
          if (w.empty()) fail("{% if %} without {% endif %}");
          if (cond.empty()) fail("{% elif %} or {% else %} after {% else %}");
          cond = w == "else" ? "" : last_rest_;
          if (w == "elif" && cond.empty()) fail("{% elif %} without a condition");
        }
        body.push_back(std::move(n));
      } else if (word == "for") {
        auto n = std::make_unique<Node>();
        n->kind = Node::kFor;
        ExprParser ep(lex_expr(rest));
        std::string vars = ep.want_name();
        if (ep.tok().kind == Tok::kOp && ep.tok().text == ",") {
          ep.skip();
          vars += "," + ep.want_name();
        }
        if (!(ep.tok().kind == Tok::kName && ep.tok().text == "in")) fail("{% for %} needs 'in'");
        ep.skip();
        n->text = vars;
        n->exprs.push_back(ep.expr());
        if (ep.tok().kind != Tok::kEnd) fail("{% for ... if %} and recursive loops are not supported");
        n->bodies.emplace_back();
        std::string w = parse(n->bodies.back(), {"else", "endfor"});
        n->bodies.emplace_back();
        if (w == "else") w = parse(n->bodies.back(), {"endfor"});
        if (w != "endfor") fail("{% for %} without {% endfor %}");
        body.push_back(std::move(n));
      } else if (word == "set") {
        const size_t eq = rest.find('=');
        if (eq == std::string::npos) fail("{% set %} blocks are not supported (only {% set x = expr %})");
        auto n = std::make_unique<Node>();
        n->kind = Node::kSet;
        n->text = strip(rest.substr(0, eq), true, true);
        for (char c : n->text)
          if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_'))
            fail("{% set " + n->text + " %}: only a plain name can be set");
        n->exprs.push_back(ExprParser(lex_expr(rest.substr(eq + 1))).parse_all());
        body.push_back(std::move(n));
      } else {
        fail("{% " + word + " %} is not supported");
      }
    }
    return "";
  }

 private:
  std::vector<RawTag> t_;
  size_t p_ = 0;
  std::string last_rest_;
};

// ---- evaluation ----------------------------------------------------------------------------------

class Renderer {
 public:
  explicit Renderer(const std::map<std::string, TValue>& vars) { scopes_.emplace_back(vars.begin(), vars.end()); }

  void body(const Body& b, std::string& out) {
    for (const auto& n : b) node(*n, out);
  }

 private:
  std::vector<std::map<std::string, TValue>> scopes_;

  TValue lookup(const std::string& name) {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    return TValue();
  }

  void node(const Node& n, std::string& out) {
    switch (n.kind) {
      case Node::kText: out += n.text; break;
      case Node::kOut: out += to_str(eval(*n.exprs[0])); break;
      case Node::kSet: scopes_.back()[n.text] = eval(*n.exprs[0]); break;
      case Node::kIf:
        for (size_t i = 0; i < n.exprs.size(); ++i)
          if (!n.exprs[i] || truthy(eval(*n.exprs[i]))) {
            body(n.bodies[i], out);
            break;
          }
        break;
      case Node::kFor: {
        TValue seq = eval(*n.exprs[0]);
        std::vector<TValue> items;
        if (seq.kind == TValue::kList) items = *seq.list;
        else if (seq.kind == TValue::kMap) for (const auto& kv : *seq.map) items.push_back(TValue::str(kv.first));
        else if (seq.kind == TValue::kStr) for (char c : seq.s) items.push_back(TValue::str(std::string(1, c)));
        else if (seq.kind != TValue::kUndefined && seq.kind != TValue::kNone)
          fail(std::string("cannot loop over a ") + kind_name(seq));
        else if (seq.kind == TValue::kNone) fail("cannot loop over none");
        if (items.empty()) {
          body(n.bodies[1], out);
          break;
        }
        const size_t comma = n.text.find(',');
        for (size_t i = 0; i < items.size(); ++i) {
          std::map<std::string, TValue> scope;
          TValue loop = TValue::new_map();
          const int64_t len = static_cast<int64_t>(items.size()), k = static_cast<int64_t>(i);
          loop.set("index", TValue::integer(k + 1));
          loop.set("index0", TValue::integer(k));
          loop.set("revindex", TValue::integer(len - k));
          loop.set("revindex0", TValue::integer(len - k - 1));
          loop.set("first", TValue::boolean(i == 0));
          loop.set("last", TValue::boolean(i + 1 == items.size()));
          loop.set("length", TValue::integer(len));
          scope["loop"] = loop;
          if (comma == std::string::npos) {
            scope[n.text] = items[i];
          } else {
            const TValue& it = items[i];
            if (it.kind != TValue::kList || it.list->size() != 2) fail("cannot unpack a loop item into two names");
            scope[n.text.substr(0, comma)] = (*it.list)[0];
            scope[n.text.substr(comma + 1)] = (*it.list)[1];
          }
          scopes_.push_back(std::move(scope));
          body(n.bodies[0], out);
          scopes_.pop_back();
        }
        break;
      }
    }
  }

  TValue attr(const TValue& obj, const std::string& name) {
    if (obj.kind == TValue::kMap) {
      const TValue* v = obj.get(name);
      return v ? *v : TValue();
    }
    if (obj.kind == TValue::kUndefined) fail("'" + name + "' of an undefined value");
    return TValue();  // e.g. a string's method name: only valid when called (see call())
  }

  TValue index(const TValue& obj, const TValue& key) {
    if (obj.kind == TValue::kMap) {
      if (key.kind != TValue::kStr) return TValue();
      const TValue* v = obj.get(key.s);
      return v ? *v : TValue();
    }
    if (obj.kind == TValue::kList || obj.kind == TValue::kStr) {
      const int64_t n = obj.kind == TValue::kList ? static_cast<int64_t>(obj.list->size()) : static_cast<int64_t>(obj.s.size());
      int64_t k = as_int(key, "an index");
      if (k < 0) k += n;
      if (k < 0 || k >= n) return TValue();
      return obj.kind == TValue::kList ? (*obj.list)[static_cast<size_t>(k)] : TValue::str(obj.s.substr(static_cast<size_t>(k), 1));
    }
    if (obj.kind == TValue::kUndefined) fail("indexing an undefined value");
    fail(std::string("cannot index a ") + kind_name(obj));
  }

  TValue call(const Expr& e) {
    const Expr& f = *e.a[0];
    std::vector<TValue> args;
    for (size_t i = 1; i < e.a.size(); ++i) args.push_back(eval(*e.a[i]));
    if (f.kind == Expr::kName) {
      if (f.op == "raise_exception") fail(args.empty() ? "raise_exception()" : to_str(args[0]));
      fail("the function " + f.op + "() is not supported");
    }
    if (f.kind != Expr::kAttr) fail("only functions and methods can be called");
    const TValue obj = eval(*f.a[0]);
    const std::string& m = f.op;
    if (obj.kind == TValue::kStr) {
      const std::string chars = args.empty() ? " \t\n\r\f\v" : to_str(args[0]);
      if (m == "strip") return TValue::str(strip(obj.s, true, true, chars));
      if (m == "lstrip") return TValue::str(strip(obj.s, true, false, chars));
      if (m == "rstrip") return TValue::str(strip(obj.s, false, true, chars));
      if (m == "upper" || m == "lower") {
        std::string s = obj.s;
        for (char& c : s) c = static_cast<char>(m == "upper" ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
        return TValue::str(s);
      }
      if ((m == "startswith" || m == "endswith") && args.size() == 1 && args[0].kind == TValue::kStr) {
        const std::string& x = args[0].s;
        const bool ok = x.size() <= obj.s.size() &&
                        (m == "startswith" ? obj.s.compare(0, x.size(), x) == 0 : obj.s.compare(obj.s.size() - x.size(), x.size(), x) == 0);
        return TValue::boolean(ok);
      }
    }
    if (obj.kind == TValue::kMap) {
      if (m == "get" && !args.empty()) {
        const TValue* v = args[0].kind == TValue::kStr ? obj.get(args[0].s) : nullptr;
        return v ? *v : (args.size() > 1 ? args[1] : TValue::none());
      }
      if (m == "items" || m == "keys" || m == "values") {
        TValue l = TValue::new_list();
        for (const auto& kv : *obj.map) {
          if (m == "keys") { l.list->push_back(TValue::str(kv.first)); continue; }
          if (m == "values") { l.list->push_back(kv.second); continue; }
          TValue pair = TValue::new_list();
          pair.list->push_back(TValue::str(kv.first));
          pair.list->push_back(kv.second);
          l.list->push_back(pair);
        }
        return l;
      }
    }
    fail(std::string("the method ") + kind_name(obj) + "." + m + "() is not supported");
  }

  TValue filter(const Expr& e) {
    const TValue v = eval(*e.a[0]);
    const std::string& f = e.op;
    if (f == "trim") return TValue::str(strip(to_str(v), true, true));
    if (f == "string") return TValue::str(to_str(v));
    if (f == "upper" || f == "lower") {
      std::string s = to_str(v);
      for (char& c : s) c = static_cast<char>(f == "upper" ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
      return TValue::str(s);
    }
    if (f == "length" || f == "count") {
      if (v.kind == TValue::kStr) return TValue::integer(static_cast<int64_t>(utf8_len(v.s)));
      if (v.kind == TValue::kList) return TValue::integer(static_cast<int64_t>(v.list->size()));
      if (v.kind == TValue::kMap) return TValue::integer(static_cast<int64_t>(v.map->size()));
      fail(std::string("length of a ") + kind_name(v));
    }
    if (f == "first" || f == "last") {
      if (v.kind == TValue::kList) return v.list->empty() ? TValue() : (f == "first" ? v.list->front() : v.list->back());
      if (v.kind == TValue::kStr) return v.s.empty() ? TValue() : TValue::str(f == "first" ? v.s.substr(0, 1) : v.s.substr(v.s.size() - 1));
      fail(std::string(f) + " of a " + kind_name(v));
    }
    if (f == "default" || f == "d") {
      if (v.kind != TValue::kUndefined) return v;
      return e.a.size() > 1 ? eval(*e.a[1]) : TValue::str("");
    }
    fail("the filter |" + f + " is not supported");
  }

  bool test(const Expr& e) {
    const TValue v = eval(*e.a[0]);
    const std::string& t = e.op;
    bool r;
    if (t == "string") r = v.kind == TValue::kStr;
    else if (t == "mapping") r = v.kind == TValue::kMap;
    else if (t == "iterable") r = v.kind == TValue::kStr || v.kind == TValue::kList || v.kind == TValue::kMap;
    else if (t == "sequence") r = v.kind == TValue::kStr || v.kind == TValue::kList || v.kind == TValue::kMap;
    else if (t == "defined") r = v.kind != TValue::kUndefined;
    else if (t == "undefined") r = v.kind == TValue::kUndefined;
    else if (t == "none") r = v.kind == TValue::kNone;
    else if (t == "number" || t == "integer") r = v.kind == TValue::kInt;
    else if (t == "boolean") r = v.kind == TValue::kBool;
    else fail("the test 'is " + t + "' is not supported");
    return r != e.neg;
  }

  TValue binary(const Expr& e) {
    const std::string& op = e.op;
    if (op == "and") {
      TValue l = eval(*e.a[0]);
      return truthy(l) ? eval(*e.a[1]) : l;
    }
    if (op == "or") {
      TValue l = eval(*e.a[0]);
      return truthy(l) ? l : eval(*e.a[1]);
    }
    const TValue l = eval(*e.a[0]), r = eval(*e.a[1]);
    if (op == "==") return TValue::boolean(equal(l, r));
    if (op == "!=") return TValue::boolean(!equal(l, r));
    if (op == "~") return TValue::str(to_str(l) + to_str(r));
    if (op == "in" || op == "not in") {
      bool found = false;
      if (r.kind == TValue::kStr) found = l.kind == TValue::kStr && r.s.find(l.s) != std::string::npos;
      else if (r.kind == TValue::kList) found = std::any_of(r.list->begin(), r.list->end(), [&](const TValue& x) { return equal(x, l); });
      else if (r.kind == TValue::kMap) found = l.kind == TValue::kStr && r.get(l.s) != nullptr;
      else fail(std::string("'in' a ") + kind_name(r));
      return TValue::boolean(found != (op == "not in"));
    }
    if (op == "+" && l.kind == TValue::kStr && r.kind == TValue::kStr) return TValue::str(l.s + r.s);
    if (op == "+" && l.kind == TValue::kList && r.kind == TValue::kList) {
      TValue out = TValue::new_list();
      *out.list = *l.list;
      out.list->insert(out.list->end(), r.list->begin(), r.list->end());
      return out;
    }
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      int c;
      if (l.kind == TValue::kStr && r.kind == TValue::kStr) c = l.s.compare(r.s);
      else {
        const int64_t a = as_int(l, "a comparison"), b = as_int(r, "a comparison");
        c = a < b ? -1 : a > b ? 1 : 0;
      }
      return TValue::boolean(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
    }
    const int64_t a = as_int(l, ("'" + op + "'").c_str()), b = as_int(r, ("'" + op + "'").c_str());
    if (op == "+") return TValue::integer(a + b);
    if (op == "-") return TValue::integer(a - b);
    if (op == "*") return TValue::integer(a * b);
    if (op == "%" || op == "//") {
      if (b == 0) fail("division by zero");
      int64_t q = a / b, m = a % b;
      if (m != 0 && ((m < 0) != (b < 0))) { m += b; --q; }  // Python's floor semantics
      return TValue::integer(op == "%" ? m : q);
    }
    fail("the operator '" + op + "' is not supported here");
  }

  TValue eval(const Expr& e) {
    switch (e.kind) {
      case Expr::kLit: return e.lit;
      case Expr::kName: return lookup(e.op);
      case Expr::kList: {
        TValue l = TValue::new_list();
        for (const auto& x : e.a) l.list->push_back(eval(*x));
        return l;
      }
      case Expr::kDict: {
        TValue m = TValue::new_map();
        for (size_t i = 0; i + 1 < e.a.size(); i += 2) m.set(to_str(eval(*e.a[i])), eval(*e.a[i + 1]));
        return m;
      }
      case Expr::kAttr: return attr(eval(*e.a[0]), e.op);
      case Expr::kIndex: return index(eval(*e.a[0]), eval(*e.a[1]));
      case Expr::kSlice: {
        const TValue obj = eval(*e.a[0]);
        TValue s0, s1;
        if (e.a[1]) s0 = eval(*e.a[1]);
        if (e.a[2]) s1 = eval(*e.a[2]);
        int64_t a, b;
        if (obj.kind == TValue::kList) {
          slice_bounds(static_cast<int64_t>(obj.list->size()), e.a[1] ? &s0 : nullptr, e.a[2] ? &s1 : nullptr, a, b);
          TValue l = TValue::new_list();
          l.list->assign(obj.list->begin() + a, obj.list->begin() + b);
          return l;
        }
        if (obj.kind == TValue::kStr) {
          slice_bounds(static_cast<int64_t>(obj.s.size()), e.a[1] ? &s0 : nullptr, e.a[2] ? &s1 : nullptr, a, b);
          return TValue::str(obj.s.substr(static_cast<size_t>(a), static_cast<size_t>(b - a)));
        }
        fail(std::string("cannot slice a ") + kind_name(obj));
      }
      case Expr::kCall: return call(e);
      case Expr::kFilter: return filter(e);
      case Expr::kTest: return TValue::boolean(test(e));
      case Expr::kUnary: {
        const TValue v = eval(*e.a[0]);
        if (e.op == "not") return TValue::boolean(!truthy(v));
        return TValue::integer(-as_int(v, "unary '-'"));
      }
      case Expr::kBinary: return binary(e);
      case Expr::kCond: {
        if (truthy(eval(*e.a[1]))) return eval(*e.a[0]);
        return e.a[2] ? eval(*e.a[2]) : TValue();
      }
    }
    return TValue();
  }
};

}  // namespace

ChatTemplate::ChatTemplate(const std::string& source) {
  std::string src = source;
  if (!src.empty() && src.back() == '\n') src.pop_back();  // jinja2's keep_trailing_newline=False
  BodyParser p(split(src));
  const std::string w = p.parse(body_, {"endif", "endfor", "elif", "else"});
  if (!w.empty()) fail("{% " + w + " %} without its opening tag");
}

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;

std::string ChatTemplate::render(const std::map<std::string, TValue>& vars) const {
  std::string out;
  Renderer r(vars);
  r.body(body_, out);
  return out;
}

}  // namespace pagedkv_rt
