// JNI bridge for org.pagedkv.demo.NativeRunner (java/org/pagedkv/demo/NativeRunner.java).
// Only <jni.h>: the same library works in the Android app and on a host JVM (tests).
#include <jni.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "json.h"
#include "runner.h"

using namespace pagedkv_rt;

namespace {

// UTF-8 bytes -> UTF-16 (invalid bytes become U+FFFD), for NewString (NewStringUTF wants modified UTF-8).
std::u16string utf8_to_utf16(const std::string& s) {
  std::u16string out;
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    i += next_utf8(s, i, &cp);
    if (cp >= 0x10000) {
      cp -= 0x10000;
      out += static_cast<char16_t>(0xD800 + (cp >> 10));
      out += static_cast<char16_t>(0xDC00 + (cp & 0x3FF));
    } else {
      out += static_cast<char16_t>(cp);
    }
  }
  return out;
}

std::string utf16_to_utf8(const jchar* p, jsize n) {
  std::string out;
  for (jsize i = 0; i < n; ++i) {
    uint32_t cp = p[i];
    if (cp >= 0xD800 && cp < 0xDC00 && i + 1 < n && p[i + 1] >= 0xDC00 && p[i + 1] < 0xE000) {
      cp = 0x10000 + ((cp - 0xD800) << 10) + (p[i + 1] - 0xDC00);
      ++i;
    } else if (cp >= 0xD800 && cp < 0xE000) {
      cp = 0xFFFD;
    }
    pagedkv_rt::append_utf8(out, cp);
  }
  return out;
}

jstring to_jstring(JNIEnv* env, const std::string& s) {
  std::u16string u = utf8_to_utf16(s);
  return env->NewString(reinterpret_cast<const jchar*>(u.data()), static_cast<jsize>(u.size()));
}

std::string from_jstring(JNIEnv* env, jstring s) {
  if (!s) return std::string();
  const jsize n = env->GetStringLength(s);
  const jchar* p = env->GetStringChars(s, nullptr);
  std::string out = utf16_to_utf8(p, n);
  env->ReleaseStringChars(s, p);
  return out;
}

void throw_java(JNIEnv* env, int code, const std::string& msg) {
  const char* cls = code == static_cast<int>(ErrorCode::kPoolExhausted) ? "org/pagedkv/demo/PoolExhaustedException"
                                                                        : "org/pagedkv/demo/PagedKVException";
  jclass k = env->FindClass(cls);
  if (!k) return;  // NoClassDefFoundError is pending
  jmethodID ctor = env->GetMethodID(k, "<init>", "(ILjava/lang/String;)V");
  if (!ctor) return;
  jobject ex = env->NewObject(k, ctor, static_cast<jint>(code), to_jstring(env, msg));
  if (ex) env->Throw(static_cast<jthrowable>(ex));
}

// Runs f, turning C++ exceptions into Java exceptions.
template <class F, class R>
R guarded(JNIEnv* env, R fallback, F&& f) {
  try {
    return f();
  } catch (const RunnerError& e) {
    if (!env->ExceptionCheck()) throw_java(env, static_cast<int>(e.code()), e.what());
  } catch (const std::exception& e) {
    if (!env->ExceptionCheck()) throw_java(env, 0, std::string("native error: ") + e.what());
  } catch (...) {  // nothing may unwind into the JVM
    if (!env->ExceptionCheck()) throw_java(env, 0, "native error: an unknown C++ exception");
  }
  return fallback;
}

Runner* R(jlong h) { return reinterpret_cast<Runner*>(static_cast<intptr_t>(h)); }

Runner* checked(JNIEnv* env, jlong h) {
  if (!h) throw RunnerError(ErrorCode::kState, "the NativeRunner was closed");
  return R(h);
}

jintArray to_jints(JNIEnv* env, const std::vector<int32_t>& v) {
  jintArray a = env->NewIntArray(static_cast<jsize>(v.size()));
  if (a) env->SetIntArrayRegion(a, 0, static_cast<jsize>(v.size()), reinterpret_cast<const jint*>(v.data()));
  return a;
}

std::vector<int32_t> from_jints(JNIEnv* env, jintArray a) {
  std::vector<int32_t> v;
  if (!a) return v;
  v.resize(static_cast<size_t>(env->GetArrayLength(a)));
  env->GetIntArrayRegion(a, 0, static_cast<jsize>(v.size()), reinterpret_cast<jint*>(v.data()));
  return v;
}

}  // namespace

#define JNI_FN(name) JNICALL Java_org_pagedkv_demo_NativeRunner_##name

extern "C" {

// policy: RunnerConfig::policy ("error", "sliding", "adaptive"); horizon: compact_horizon; spill_dir: "" = no spill rung.
JNIEXPORT jlong JNI_FN(nativeCreate)(JNIEnv* env, jclass, jstring dir, jlong budget, jint threads, jstring isa,
                                     jstring policy, jint horizon, jstring spill_dir) {
  return guarded(env, jlong(0), [&] {
    RunnerConfig c;
    c.artifacts_dir = from_jstring(env, dir);
    c.pool_budget_bytes = budget;
    c.num_threads = threads;
    c.isa = from_jstring(env, isa);
    c.policy = from_jstring(env, policy);
    c.compact_horizon = horizon;
    c.spill_dir = from_jstring(env, spill_dir);
    return static_cast<jlong>(reinterpret_cast<intptr_t>(new Runner(c)));
  });
}

JNIEXPORT void JNI_FN(nativeDestroy)(JNIEnv*, jclass, jlong h) { delete R(h); }

JNIEXPORT jint JNI_FN(nativeNewConversation)(JNIEnv* env, jclass, jlong h) {
  return guarded(env, jint(-1), [&] { return static_cast<jint>(checked(env, h)->new_conversation()); });
}

JNIEXPORT void JNI_FN(nativeClear)(JNIEnv* env, jclass, jlong h, jint conv) {
  guarded(env, 0, [&] { checked(env, h)->clear(conv); return 0; });
}

JNIEXPORT void JNI_FN(nativeCloseConversation)(JNIEnv* env, jclass, jlong h, jint conv) {
  guarded(env, 0, [&] { checked(env, h)->close(conv); return 0; });
}

// Conversation files (Runner::save / Runner::restore): save returns the file's size; restore the new
// conversation's id. A bad file throws PagedKVException (or PoolExhaustedException) with one line.
JNIEXPORT jlong JNI_FN(nativeSave)(JNIEnv* env, jclass, jlong h, jint conv, jstring path) {
  return guarded(env, jlong(-1), [&] { return static_cast<jlong>(checked(env, h)->save(conv, from_jstring(env, path))); });
}

// Runner::compact: conv's blocks ending >= horizon tokens back re-quantized into the compact region (onTrimMemory);
// returns how many blocks moved. A .pte without a compact region throws PagedKVException (ARGUMENT).
JNIEXPORT jint JNI_FN(nativeCompact)(JNIEnv* env, jclass, jlong h, jint conv, jint horizon) {
  return guarded(env, jint(-1), [&] { return static_cast<jint>(checked(env, h)->compact(conv, horizon).size()); });
}

JNIEXPORT jint JNI_FN(nativeRestore)(JNIEnv* env, jclass, jlong h, jstring path) {
  return guarded(env, jint(-1), [&] { return static_cast<jint>(checked(env, h)->restore(from_jstring(env, path))); });
}

}  // extern "C"

namespace {

// The listener's onToken as a TokenCallback (a pending Java exception stops generation; rethrown on return).
TokenCallback java_listener(JNIEnv* env, jobject listener, bool* ok) {
  *ok = true;
  if (!listener) return TokenCallback();
  jclass k = env->GetObjectClass(listener);
  jmethodID on_token = env->GetMethodID(k, "onToken", "(ILjava/lang/String;)Z");
  if (!on_token) {
    *ok = false;
    return TokenCallback();
  }
  return [env, listener, on_token](int32_t id, const std::string& text) -> bool {
    jstring js = to_jstring(env, text);
    jboolean go = env->CallBooleanMethod(listener, on_token, static_cast<jint>(id), js);
    env->DeleteLocalRef(js);
    if (env->ExceptionCheck()) return false;  // rethrown to the caller when generate returns
    return go == JNI_TRUE;
  };
}

Sampling sampling(jfloat temperature, jint top_k, jfloat top_p, jlong seed) {
  Sampling sp;
  sp.temperature = temperature;
  sp.top_k = top_k;
  sp.top_p = top_p;
  sp.seed = static_cast<uint64_t>(seed);
  return sp;
}

}  // namespace

extern "C" {

JNIEXPORT jintArray JNI_FN(nativeGenerate)(JNIEnv* env, jclass, jlong h, jint conv, jintArray prompt, jint max_new,
                                           jfloat temperature, jint top_k, jfloat top_p, jlong seed,
                                           jobject listener) {
  return guarded(env, static_cast<jintArray>(nullptr), [&]() -> jintArray {
    Runner* r = checked(env, h);
    bool ok;
    TokenCallback cb = java_listener(env, listener, &ok);
    if (!ok) return nullptr;
    auto out = r->generate(conv, from_jints(env, prompt), max_new, sampling(temperature, top_k, top_p, seed), cb);
    if (env->ExceptionCheck()) return nullptr;
    return to_jints(env, out);
  });
}

JNIEXPORT jintArray JNI_FN(nativeChat)(JNIEnv* env, jclass, jlong h, jint conv, jstring text, jint max_new,
                                       jfloat temperature, jint top_k, jfloat top_p, jlong seed, jobject listener) {
  return guarded(env, static_cast<jintArray>(nullptr), [&]() -> jintArray {
    Runner* r = checked(env, h);
    bool ok;
    TokenCallback cb = java_listener(env, listener, &ok);
    if (!ok) return nullptr;
    auto out = r->chat(conv, from_jstring(env, text), max_new, sampling(temperature, top_k, top_p, seed), cb);
    if (env->ExceptionCheck()) return nullptr;
    return to_jints(env, out);
  });
}

JNIEXPORT jstring JNI_FN(nativeRenderChat)(JNIEnv* env, jclass, jlong h, jint conv, jstring text) {
  return guarded(env, static_cast<jstring>(nullptr),
                 [&] { return to_jstring(env, checked(env, h)->render_chat(conv, from_jstring(env, text))); });
}

JNIEXPORT jintArray JNI_FN(nativeEncode)(JNIEnv* env, jclass, jlong h, jstring text) {
  return guarded(env, static_cast<jintArray>(nullptr),
                 [&] { return to_jints(env, checked(env, h)->tokenizer().encode(from_jstring(env, text))); });
}

JNIEXPORT jstring JNI_FN(nativeDecode)(JNIEnv* env, jclass, jlong h, jintArray ids) {
  return guarded(env, static_cast<jstring>(nullptr),
                 [&] { return to_jstring(env, checked(env, h)->tokenizer().decode(from_jints(env, ids), true)); });
}

JNIEXPORT void JNI_FN(nativeCancel)(JNIEnv* env, jclass, jlong h) {
  guarded(env, 0, [&] { checked(env, h)->cancel(); return 0; });
}

// [requested, usable_before, usable_after, blocked_by_used, released_bytes]
JNIEXPORT jlongArray JNI_FN(nativeShrink)(JNIEnv* env, jclass, jlong h, jint target) {
  return guarded(env, static_cast<jlongArray>(nullptr), [&] {
    ShrinkResult s = checked(env, h)->shrink(target);
    jlong v[5] = {s.requested_blocks, s.usable_before, s.usable_after, s.blocked_by_used, s.released_bytes};
    jlongArray a = env->NewLongArray(5);
    if (a) env->SetLongArrayRegion(a, 0, 5, v);
    return a;
  });
}

JNIEXPORT jint JNI_FN(nativeGrow)(JNIEnv* env, jclass, jlong h, jint target) {
  return guarded(env, jint(0), [&] { return static_cast<jint>(checked(env, h)->grow(target)); });
}

// Order must match NativeRunner.Stats.fromArray.
JNIEXPORT jdoubleArray JNI_FN(nativeStats)(JNIEnv* env, jclass, jlong h) {
  return guarded(env, static_cast<jdoubleArray>(nullptr), [&] {
    PoolStats s = checked(env, h)->stats();
    const LadderStats& l = s.ladder;  // the compact region and the pressure ladder's rungs (runner.h LadderStats)
    jdouble v[28] = {double(s.total_blocks), double(s.usable_blocks), double(s.used_blocks), double(s.free_blocks),
                     double(s.block_size), double(s.sequences), double(s.kv_bytes_in_use), double(s.bytes_per_block),
                     double(s.committed_bytes), double(s.reserved_bytes), double(s.largest_allocation_bytes),
                     double(s.num_allocations), double(s.prefill_tokens), double(s.decode_tokens), s.prefill_tok_s,
                     s.decode_tok_s, double(s.compact_blocks), double(s.compact_bytes), double(l.slides),
                     double(l.spills), double(l.spill_bytes), double(l.spill_failures), double(l.restores_from_spill),
                     double(l.spill_reprefills), double(l.spilled_now), double(l.compactions),
                     double(l.compacted_blocks), double(l.compact_blocks_in_use)};
    jdoubleArray a = env->NewDoubleArray(28);
    if (a) env->SetDoubleArrayRegion(a, 0, 28, v);
    return a;
  });
}

JNIEXPORT jstring JNI_FN(nativeIsa)(JNIEnv* env, jclass, jlong h) {
  return guarded(env, static_cast<jstring>(nullptr), [&] { return to_jstring(env, checked(env, h)->stats().isa); });
}

JNIEXPORT jintArray JNI_FN(nativeStopTokens)(JNIEnv* env, jclass, jlong h) {
  return guarded(env, static_cast<jintArray>(nullptr), [&] { return to_jints(env, checked(env, h)->stop_tokens()); });
}

}  // extern "C"
