// What the native kernels ask of Python, with the GIL: the op's Python kernels and its shape rule.
#pragma once

#include "op_state.h"

namespace opbridge_native {

// The signature a shape rule's answer depends on: shapes and dtypes of tensors, scalar values.
std::vector<int64_t> RuleKey(const OpState& st, const c10::IValue* args) {
  std::vector<int64_t> key;
  key.reserve(4 * st.kinds.size());  // one allocation for the usual shapes (ndim, 2 dims, dtype)
  for (size_t i = 0; i < st.kinds.size(); ++i) {
    const c10::IValue& v = args[i];
    if (v.isNone()) {
      key.push_back(-1);
    } else if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      key.push_back(t.dim());
      key.insert(key.end(), t.sizes().begin(), t.sizes().end());
      key.push_back(static_cast<int64_t>(t.scalar_type()));
    } else if (v.isDouble()) {
      double d = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      key.push_back(bits);
    } else if (v.isInt()) {
      key.push_back(v.toInt());
    } else if (v.isBool()) {
      key.push_back(v.toBool());
    }
  }
  return key;
}

py::object ToPy(const c10::IValue& v) {
  if (v.isTensor()) return py::cast(v.toTensor());
  if (v.isDouble()) return py::float_(v.toDouble());
  if (v.isInt()) return py::int_(v.toInt());
  if (v.isBool()) return py::bool_(v.toBool());
  return py::none();
}

// The Python call of *fn* on the stack's arguments (kwarg-only ones by name), its result pushed.
void CallPython(const OpState& st, const py::object& fn, const c10::DispatchKeySet* ks,
                torch::jit::Stack* stack) {
  const size_t n = st.kinds.size();
  std::vector<c10::IValue> args(std::make_move_iterator(stack->end() - n),
                                std::make_move_iterator(stack->end()));
  torch::jit::drop(*stack, n);
  py::gil_scoped_acquire gil;
  py::list pos;
  py::dict kw;
  if (ks != nullptr) pos.append(py::cast(*ks));
  const auto& schema = st.op.schema();
  for (size_t i = 0; i < n; ++i) {
    if (st.kwarg_only[i]) {
      kw[py::str(schema.arguments()[i].name())] = ToPy(args[i]);
    } else {
      pos.append(ToPy(args[i]));
    }
  }
  py::object result = fn(*py::tuple(pos), **kw);
  const size_t n_returns = st.returns.size();
  if (n_returns == 1) {
    stack->emplace_back(result.cast<at::Tensor>());
  } else if (n_returns > 1) {
    for (const auto& r : py::cast<py::tuple>(result)) stack->emplace_back(r.cast<at::Tensor>());
  }
}

// The outputs' shapes and dtypes from the op's shape rule, asked once per argument signature.
std::vector<OutSpec> RuleSpecs(OpState& st, const c10::IValue* args) {
  std::vector<int64_t> key = RuleKey(st, args);
  {
    std::lock_guard<std::mutex> lock(st.rule_mutex);
    auto it = st.rule_cache.find(key);
    if (it != st.rule_cache.end()) return it->second;
  }
  std::vector<OutSpec> specs;
  {
    py::gil_scoped_acquire gil;
    py::tuple pyargs(st.kinds.size());
    for (size_t i = 0; i < st.kinds.size(); ++i) pyargs[i] = ToPy(args[i]);
    for (const auto& m : py::cast<py::list>(st.rule(pyargs))) {
      at::Tensor t = m.cast<at::Tensor>();
      specs.push_back({t.sizes().vec(), t.scalar_type()});
    }
  }
  std::lock_guard<std::mutex> lock(st.rule_mutex);
  if (st.rule_cache.size() >= kRuleCacheSize) st.rule_cache.clear();
  st.rule_cache[std::move(key)] = specs;
  return specs;
}

// Whether *outs* (out=) have the shapes and dtypes of the shape rule's answer for *args*: compared under
// the cache's lock, without copying the answer (RuleSpecs copies it: another thread may clear the cache).
bool RuleOutsMatch(OpState& st, const c10::IValue* args, const c10::SmallVectorImpl<at::Tensor>& outs) {
  auto match = [&](const std::vector<OutSpec>& specs) {
    if (specs.size() != outs.size()) return false;
    for (size_t k = 0; k < specs.size(); ++k) {
      if (outs[k].scalar_type() != specs[k].dtype || outs[k].sizes() != c10::IntArrayRef(specs[k].shape)) return false;
    }
    return true;
  };
  {
    std::vector<int64_t> key = RuleKey(st, args);
    std::lock_guard<std::mutex> lock(st.rule_mutex);
    auto it = st.rule_cache.find(key);
    if (it != st.rule_cache.end()) return match(it->second);
  }
  return match(RuleSpecs(st, args));
}

}  // namespace opbridge_native
