// onnxruntime custom-op library: domain "pagedkv", op "QuantizedPagedAttention" (the functional form).
// Inputs:  q, k, v, codes, scales, stage, positions, seq_ids, block_tables, sinks
// Outputs: out [1,T,Hq,D] float, codes, scales, stage (the updated pools)
// Attributes: layer, k_bits, v_bits, k_group, v_group, k_sym, v_sym, rotate, fp_tail, sink_blocks,
//             window (ints), scale, softcap (floats).
// And "QuantizedPagedAttentionMixed" (the mixed-table op, the compact tier): inputs compact_codes (uint8)
// and compact_scales (float16) after stage, read only; attributes ck_bits, cv_bits, ck_group, cv_group,
// ck_sym, cv_sym (ints) more. Outputs as above.
// When ORT hands the same buffer as pool input and output (IOBinding with one OrtValue), the pools are
// updated in place; otherwise the input is copied to the output first.
// Built with ORT_API_MANUAL_INIT against the ORT 1.29 headers (API version 29); not linked to ORT.
#include <cstring>
#include <string>
#include <vector>

#include "onnxruntime_cxx_api.h"
#include "pagedkv_core.h"
#include "pagedkv_host.h"

namespace {

using pagedkv::CodesType;
using pagedkv::Dims;

struct Kernel {
  pagedkv::OpScalars s;
  pagedkv::CompactScalars compact;  // the mixed op
  bool mixed;
  const OrtApi* api;

  Kernel(const OrtApi& a, const OrtKernelInfo* info, bool mixed_op) : mixed(mixed_op), api(&a) {
    Ort::ConstKernelInfo ki(info);
    auto geti = [&](const char* name, int64_t def) -> int64_t {
      int64_t v = def;
      OrtStatus* st = api->KernelInfoGetAttribute_int64(info, name, &v);
      if (st) {
        api->ReleaseStatus(st);
        return def;
      }
      return v;
    };
    auto getf = [&](const char* name, double def) -> double {
      float v = (float)def;
      OrtStatus* st = api->KernelInfoGetAttribute_float(info, name, &v);
      if (st) {
        api->ReleaseStatus(st);
        return def;
      }
      return v;
    };
    s.layer = geti("layer", 0);
    s.k_bits = geti("k_bits", 8);
    s.v_bits = geti("v_bits", 4);
    s.k_group = geti("k_group", 64);
    s.v_group = geti("v_group", 32);
    s.k_sym = geti("k_sym", 1) != 0;
    s.v_sym = geti("v_sym", 0) != 0;
    s.rotate = geti("rotate", 1) != 0;
    s.fp_tail = geti("fp_tail", 1) != 0;
    s.sink_blocks = geti("sink_blocks", 1);
    s.scale = getf("scale", 1.0);
    s.window = geti("window", 0);
    s.softcap = getf("softcap", 0.0);
    if (mixed) {
      compact.ck_bits = geti("ck_bits", 4);
      compact.cv_bits = geti("cv_bits", 3);
      compact.ck_group = geti("ck_group", 64);
      compact.cv_group = geti("cv_group", 64);
      compact.ck_sym = geti("ck_sym", 1) != 0;
      compact.cv_sym = geti("cv_sym", 0) != 0;
    }
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    try {
      return compute(context);
    } catch (const Ort::Exception& e) {
      return api->CreateStatus(e.GetOrtErrorCode(), e.what());
    } catch (const std::exception& e) {
      return api->CreateStatus(ORT_FAIL, e.what());
    }
  }

  OrtStatusPtr compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    std::vector<Ort::ConstValue> in;
    std::vector<std::vector<int64_t>> shapes;
    std::vector<ONNXTensorElementDataType> types;
    const size_t n_in = mixed ? 12 : 10;
    const int x = mixed ? 2 : 0;  // positions, seq_ids, block_tables, sinks come after the compact inputs
    for (size_t i = 0; i < n_in; ++i) {
      in.push_back(ctx.GetInput(i));
      auto info = in.back().GetTensorTypeAndShapeInfo();
      shapes.push_back(info.GetShape());
      types.push_back(info.GetElementType());
    }
    auto dims = [&](int i) { return Dims{shapes[i].data(), (int)shapes[i].size()}; };
    const ONNXTensorElementDataType ctype = types[3];
    CodesType ct = ctype == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8     ? CodesType::kUInt8
                   : ctype == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? CodesType::kFloat16
                   : ctype == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT   ? CodesType::kFloat32
                                                                   : CodesType::kOther;
    char err[1024] = {0};
    pagedkv::PagedAttnParams p;
    int rc = pagedkv::params_from_shapes(dims(0), dims(1), dims(2), dims(3), ct, dims(4), dims(5), dims(6 + x),
                                         dims(7 + x), dims(8 + x), dims(9 + x), s, &p, err, sizeof err);
    if (!rc && mixed)  // compact_codes' type is declared uint8 (GetInputType)
      rc = pagedkv::compact_params_from_shapes(dims(6), CodesType::kUInt8, dims(7), compact, &p, err, sizeof err);
    if (rc) return api->CreateStatus(ORT_INVALID_ARGUMENT, err);

    const std::vector<int64_t> out_shape = {1, p.T, p.Hq, p.D};
    auto out = ctx.GetOutput(0, out_shape);
    void* pools[3];
    const size_t elem[3] = {(size_t)(ct == CodesType::kUInt8 ? 1 : ct == CodesType::kFloat16 ? 2 : 4), 2, 2};
    for (int i = 0; i < 3; ++i) {
      auto o = ctx.GetOutput(1 + i, shapes[3 + i]);
      void* dst = o.GetTensorMutableRawData();
      const void* src = in[3 + i].GetTensorRawData();
      const size_t n = (size_t)Dims{shapes[3 + i].data(), (int)shapes[3 + i].size()}.numel() * elem[i];
      if (dst != src && n) std::memcpy(dst, src, n);
      pools[i] = dst;
    }
    pagedkv::PagedAttnBuffers b;
    b.q = in[0].GetTensorData<float>();
    b.k = in[1].GetTensorData<float>();
    b.v = in[2].GetTensorData<float>();
    b.codes = pools[0];
    b.scales = static_cast<uint16_t*>(pools[1]);
    b.stage = static_cast<uint16_t*>(pools[2]);
    b.positions = in[6 + x].GetTensorData<int64_t>();
    b.seq_ids = in[7 + x].GetTensorData<int64_t>();
    b.block_tables = in[8 + x].GetTensorData<int64_t>();
    b.sinks = dims(9 + x).numel() > 0 ? in[9 + x].GetTensorData<float>() : nullptr;
    if (mixed) {
      b.compact_codes = in[6].GetTensorData<uint8_t>();
      b.compact_scales = static_cast<const uint16_t*>(in[7].GetTensorRawData());
    }
    b.out = out.GetTensorMutableData<float>();
    pagedkv::HostPool host;  // the session's intra-op threads
    host.run = run_on_session_threads;
    host.ctx = context;
    rc = pagedkv::paged_attention(p, b, err, sizeof err, &host);
    if (rc) return api->CreateStatus(ORT_INVALID_ARGUMENT, err);
    return nullptr;
  }

  // pagedkv::HostPool::run on onnxruntime's intra-op thread pool (KernelContext_ParallelFor; one
  // thread when the session has intra_op_num_threads = 1). Should onnxruntime refuse, the items run
  // here (each item only reads the pool and writes its own part of the output).
  static void run_on_session_threads(void* context, int n, void (*fn)(void*, int), void* arg) {
    struct Call {
      void (*fn)(void*, int);
      void* arg;
    } call{fn, arg};
    OrtStatus* st = Ort::GetApi().KernelContext_ParallelFor(
        static_cast<OrtKernelContext*>(context),
        [](void* c, size_t i) { static_cast<Call*>(c)->fn(static_cast<Call*>(c)->arg, (int)i); }, (size_t)n, 0, &call);
    if (st) {
      Ort::GetApi().ReleaseStatus(st);
      for (int i = 0; i < n; ++i) fn(arg, i);
    }
  }
};

// The default op (Mixed = false) and the mixed-table op (Mixed = true: compact_codes, compact_scales
// after stage).
template <bool Mixed>
struct Op : Ort::CustomOpBase<Op<Mixed>, Kernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    try {
      *kernel = new Kernel(api, info, Mixed);
      return nullptr;
    } catch (const std::exception& e) {
      return api.CreateStatus(ORT_FAIL, e.what());
    }
  }
  const char* GetName() const { return Mixed ? "QuantizedPagedAttentionMixed" : "QuantizedPagedAttention"; }
  size_t GetInputTypeCount() const { return Mixed ? 12 : 10; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (Mixed && (i == 6 || i == 7))
      return i == 6 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    if (Mixed && i > 7) i -= 2;
    switch (i) {
      case 0: case 1: case 2: case 9: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
      case 3: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // uint8 codes or a float pool
      case 4: case 5: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
      default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    }
  }
  size_t GetOutputTypeCount() const { return 4; }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    switch (i) {
      case 0: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
      case 1: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
      default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    }
  }
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (!api) return nullptr;  // cannot even report: the runtime is older than API 29
  Ort::InitApi(api);
  static Op<false> op;
  static Op<true> mixed_op;
  static OrtCustomOpDomain* domain = nullptr;
  if (!domain) {
    if (OrtStatus* st = api->CreateCustomOpDomain("pagedkv", &domain)) return st;
    if (OrtStatus* st = api->CustomOpDomain_Add(domain, &op)) return st;
    if (OrtStatus* st = api->CustomOpDomain_Add(domain, &mixed_op)) return st;
  }
  return api->AddCustomOpDomain(options, domain);
}
