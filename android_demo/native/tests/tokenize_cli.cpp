// Host test helper: tokenizes each line of a file (escaped with \n for embedded newlines) and prints
// one line of space-separated ids per input line (REFUSED: text the tokenizer refuses, e.g. not NFC);
// with --decode prints the round trip instead.
//   tokenize_cli TOKENIZER_JSON LINES_FILE [--decode]   (ids with the special tokens the post-processor adds,
//   e.g. Gemma's BOS; --decode round-trips the ids without them)
#include <fstream>
#include <iostream>
#include <string>

#include "tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: tokenize_cli tokenizer.json lines.txt [--decode]\n";
    return 2;
  }
  try {
    auto tok = pagedkv_rt::Tokenizer::from_file(argv[1]);
    bool decode = argc > 3 && std::string(argv[3]) == "--decode";
    std::ifstream f(argv[2], std::ios::binary);
    std::string line;
    while (std::getline(f, line)) {
      std::string text;
      for (size_t i = 0; i < line.size(); ++i) {  // unescape \n and \\ .
        if (line[i] == '\\' && i + 1 < line.size()) {
          char e = line[++i];
          text += e == 'n' ? '\n' : e == 't' ? '\t' : e;
        } else {
          text += line[i];
        }
      }
      std::vector<int32_t> ids;
      try {
        ids = tok.encode(text, !decode);  // --decode: without the post-processor's tokens (no BOS in the text)
      } catch (const std::invalid_argument&) {
        std::cout << "REFUSED\n";
        continue;
      }
      if (decode) {
        std::cout << (tok.decode(ids) == text ? "OK" : "MISMATCH") << "\n";
        continue;
      }
      for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? " " : "") << ids[i];
      std::cout << "\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
