// template_cli TEMPLATE_FILE VARS_JSON_FILE: renders the chat template with the variables (a JSON object:
// messages, add_generation_prompt, bos_token, ...) and writes the text to stdout. A TemplateError prints
// "TemplateError: <message>" and exits 3. tests/test_android_native.py compares this with jinja2.
#include <fstream>
#include <iostream>
#include <sstream>

#include "chat_template.h"
#include "json.h"

using namespace pagedkv_rt;

static TValue to_value(const Json& j) {
  switch (j.type()) {
    case Json::Type::kNull: return TValue::none();
    case Json::Type::kBool: return TValue::boolean(j.as_bool());
    case Json::Type::kNumber: return TValue::integer(j.as_int());
    case Json::Type::kString: return TValue::str(j.as_string());
    case Json::Type::kArray: {
      TValue l = TValue::new_list();
      for (const Json& x : j.items()) l.list->push_back(to_value(x));
      return l;
    }
    case Json::Type::kObject: {
      TValue m = TValue::new_map();
      for (const auto& kv : j.members()) m.set(kv.first, to_value(kv.second));
      return m;
    }
  }
  return TValue();
}

static std::string slurp(const char* path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: template_cli TEMPLATE_FILE VARS_JSON_FILE\n";
    return 2;
  }
  try {
    ChatTemplate t(slurp(argv[1]));
    std::map<std::string, TValue> vars;
    const Json j = Json::parse(slurp(argv[2]));
    for (const auto& kv : j.members()) vars[kv.first] = to_value(kv.second);
    std::cout << t.render(vars);
  } catch (const TemplateError& e) {
    std::cout << "TemplateError: " << e.what() << "\n";
    return 3;
  }
  return 0;
}
