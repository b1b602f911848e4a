package org.pagedkv.demo.core

/**
 * Enough JSON to read pagedkv.json on the JVM without a library (org.json exists only on Android):
 * objects -> Map, arrays -> List, strings, numbers (Long or Double), booleans, null.
 */
object MiniJson {
    class Error(msg: String) : Exception(msg)

    fun parse(text: String): Any? {
        val p = Parser(text)
        val v = p.value()
        p.ws()
        if (p.i != text.length) throw Error("trailing characters at offset ${p.i}")
        return v
    }

    private class Parser(val s: String) {
        var i = 0
        fun ws() {
            while (i < s.length && s[i] in " \t\r\n") i++
        }
        fun value(): Any? {
            ws()
            if (i >= s.length) throw Error("unexpected end")
            return when (s[i]) {
                '{' -> obj()
                '[' -> arr()
                '"' -> str()
                't' -> lit("true", true)
                'f' -> lit("false", false)
                'n' -> lit("null", null)
                else -> num()
            }
        }
        fun lit(word: String, v: Any?): Any? {
            if (!s.startsWith(word, i)) throw Error("bad literal at offset $i")
            i += word.length
            return v
        }
        fun obj(): Map<String, Any?> {
            val m = LinkedHashMap<String, Any?>()
            i++
            ws()
            if (i < s.length && s[i] == '}') { i++; return m }
            while (true) {
                ws()
                if (i >= s.length || s[i] != '"') throw Error("expected a key at offset $i")
                val k = str()
                ws()
                if (i >= s.length || s[i] != ':') throw Error("expected ':' at offset $i")
                i++
                m[k] = value()
                ws()
                if (i < s.length && s[i] == ',') { i++; continue }
                if (i < s.length && s[i] == '}') { i++; return m }
                throw Error("expected ',' or '}' at offset $i")
            }
        }
        fun arr(): List<Any?> {
            val a = ArrayList<Any?>()
            i++
            ws()
            if (i < s.length && s[i] == ']') { i++; return a }
            while (true) {
                a.add(value())
                ws()
                if (i < s.length && s[i] == ',') { i++; continue }
                if (i < s.length && s[i] == ']') { i++; return a }
                throw Error("expected ',' or ']' at offset $i")
            }
        }
        fun str(): String {
            val b = StringBuilder()
            i++
            while (i < s.length) {
                val c = s[i++]
                when (c) {
                    '"' -> return b.toString()
                    '\\' -> {
                        if (i >= s.length) break
                        when (val e = s[i++]) {
                            'n' -> b.append('\n'); 't' -> b.append('\t'); 'r' -> b.append('\r')
                            'b' -> b.append('\b'); 'f' -> b.append('\u000c')
                            'u' -> {
                                if (i + 4 > s.length) throw Error("bad \\u escape")
                                b.append(s.substring(i, i + 4).toInt(16).toChar()); i += 4
                            }
                            else -> b.append(e)
                        }
                    }
                    else -> b.append(c)
                }
            }
            throw Error("unterminated string")
        }
        fun num(): Any {
            val start = i
            while (i < s.length && (s[i].isDigit() || s[i] in "+-.eE")) i++
            val t = s.substring(start, i)
            if (t.isEmpty()) throw Error("unexpected '${s[start]}' at offset $start")
            return t.toLongOrNull() ?: t.toDoubleOrNull() ?: throw Error("bad number '$t'")
        }
    }
}
