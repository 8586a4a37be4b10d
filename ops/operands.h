// Named operands: an op's inputs as a struct of named fields.
//
// Note [Named operands]
// An op's inputs are a struct template with one named field per operand,
// over the field type F: `Tensor` where the op is called, `TensorMeta` in its
// check, `Operand` (address and meta) in its launcher and host reference, and
// `int` (the input's position) for its layout. One function per struct lists
// the fields in the program's input order, with their use (read, or written
// in place) and whether this call has them (optional operands):
//
//   template <typename F> struct AttentionOperands { F q, k, v, cu_seqlens; };
//   template <typename F, typename V>
//   void visit_operands(const AttentionParams&, AttentionOperands<F>& o, V& v) {
//     v({"q"}, o.q); v({"k"}, o.k); v({"v"}, o.v); v({"cu_seqlens"}, o.cu_seqlens);
//   }
//
// flatten() makes the program's inputs from the call's struct; bind_metas()
// (checking the count, naming every operand in its error) and bind_args()
// read them back; operand_layout() gives each operand's position, and
// written_inputs_of() is the op's mutated_inputs_for. The
// order of the inputs in a program (graph keys, dumps) is the visit order,
// and nothing else counts positions. A list operand is a std::vector of
// fields: `v.list(name, items, count)` sizes it before its elements are
// visited, with kRestOfInputs for a last list as long as the inputs left;
// `v.optional_last(slot, field)` is a last operand present when the call
// gives it (a defined tensor, one more input), whatever the params.
// An op with several outputs names them the same way (all fields read):
// output_metas() is its check's result, bind_outputs() the launcher's view,
// bind_results() the call's tensors by name.
//
// An op file's operand structs live in its anonymous namespace, and their
// names are unique across ops/: GCC (12) gives a template instantiated over
// an anonymous namespace's class template (bind_args<WgradOperands>,
// written_inputs_of<...>) weak linkage under a name that does not say which
// file it came from, so two files' WgradOperands would share one
// instantiation and the linker would keep either. tests/ops/registry_test
// checks the names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/error.h"
#include "engine/op.h"
#include "engine/tensor.h"

namespace stepgraph::ops {

enum class Use {
  kRead,
  kWrite,  // written in place (OpDef::written_inputs)
};

// One operand as an op's visit function names it.
struct Slot {
  std::string_view name;
  std::int64_t index = -1;  // its element of a list operand; -1 for a single operand
  Use use = Use::kRead;
  bool present = true;  // false: an optional operand this call leaves out
};

// "grad[3]", "table".
std::string slot_name(const Slot& slot);

// The length of a list operand that takes every input left (the last operand).
inline constexpr std::size_t kRestOfInputs = std::numeric_limits<std::size_t>::max();

// An operand in a launcher or a host reference: its address and meta (both
// null for an optional operand the call leaves out).
struct Operand {
  void* data = nullptr;
  const TensorMeta* meta = nullptr;

  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
  bool present() const { return meta != nullptr; }
  const Shape& shape() const { return meta->shape; }
  DType dtype() const { return meta->dtype; }
  std::int64_t numel() const { return meta->numel(); }
};

// The meta of a field in a check (TensorMeta) or a launcher (Operand), for
// code that serves both.
inline const TensorMeta& meta_of(const TensorMeta& meta) { return meta; }
inline const TensorMeta& meta_of(const Operand& operand) { return *operand.meta; }

// The operand shapes several ops share, whatever their params: no operand
// (fill, empty, recv); one tensor read, x (copy, cast, gelu, amax, the
// collectives that read their source, quantize_blocks); two read, a and b
// (add, mul, residual_add); dst written from src (copy_, copy_rows_); and a
// list read, tensors (pack, order_after).
template <typename F>
struct NoOperands {};

template <typename P, typename F, typename V>
void visit_operands(const P&, NoOperands<F>&, V&) {}

template <typename F>
struct ReadOperand {
  F x;
};

template <typename P, typename F, typename V>
void visit_operands(const P&, ReadOperand<F>& o, V& v) {
  v({"x"}, o.x);
}

template <typename F>
struct BinaryOperands {
  F a, b;
};

template <typename P, typename F, typename V>
void visit_operands(const P&, BinaryOperands<F>& o, V& v) {
  v({"a"}, o.a);
  v({"b"}, o.b);
}

template <typename F>
struct CopyOperands {
  F dst;  // written
  F src;
};

template <typename P, typename F, typename V>
void visit_operands(const P&, CopyOperands<F>& o, V& v) {
  v({.name = "dst", .use = Use::kWrite}, o.dst);
  v({"src"}, o.src);
}

template <typename F>
struct ReadList {
  std::vector<F> tensors;  // every input, in order
};

template <typename P, typename F, typename V>
void visit_operands(const P&, ReadList<F>& o, V& v) {
  v.list("tensors", o.tensors, kRestOfInputs);
  for (std::size_t i = 0; i < o.tensors.size(); ++i)
    v({.name = "tensors", .index = static_cast<std::int64_t>(i)}, o.tensors[i]);
}

namespace operands_detail {

class Flattener {
 public:
  explicit Flattener(std::string_view op) : op_(op) {}
  void operator()(const Slot& slot, const Tensor& tensor);
  template <typename X>
  void list(std::string_view name, std::vector<X>& items, std::size_t count) {
    SG_CHECK(count == kRestOfInputs || items.size() == count, "op ", op_, ": operand list '", name, "' holds ",
             items.size(), " elements, its params say ", count);
  }
  void optional_last(Slot slot, const Tensor& tensor) {
    slot.present = tensor.defined();
    (*this)(slot, tensor);
  }
  std::vector<Tensor> take() { return std::move(inputs_); }

 private:
  std::string_view op_;
  std::vector<Tensor> inputs_;
};

// Binds fields in visit order to the inputs; counts them (past the end too).
class Binder {
 public:
  explicit Binder(std::size_t input_count) : input_count_(input_count) {}
  template <typename X>
  void list(std::string_view, std::vector<X>& items, std::size_t count) {
    items.resize(count != kRestOfInputs ? count : (next_ < input_count_ ? input_count_ - next_ : 0));
  }
  std::size_t next() const { return next_; }

 protected:
  bool inputs_left() const { return next_ < input_count_; }
  // The input the next present field binds to, or false past the end.
  bool advance(const Slot& slot, std::size_t& at) {
    if (!slot.present) return false;
    at = next_++;
    return at < input_count_;
  }

 private:
  std::size_t input_count_;
  std::size_t next_ = 0;
};

// Binds fields to a span of inputs (metas in a check) or results (a call's tensors).
template <typename T>
class SpanBinder : public Binder {
 public:
  explicit SpanBinder(std::span<const T> items) : Binder(items.size()), items_(items) {}
  void operator()(const Slot& slot, T& field) {
    std::size_t at = 0;
    if (advance(slot, at)) field = items_[at];
  }
  void optional_last(Slot slot, T& field) {
    slot.present = inputs_left();
    (*this)(slot, field);
  }

 private:
  std::span<const T> items_;
};

// Collects the present fields in visit order (a check's output metas).
template <typename T>
class Collector {
 public:
  void operator()(const Slot& slot, const T& field) {
    if (slot.present) items.push_back(field);
  }
  template <typename X>
  void list(std::string_view, std::vector<X>&, std::size_t) {}
  std::vector<T> items;
};

class ArgBinder : public Binder {
 public:
  ArgBinder(std::span<void* const> addresses, std::span<const TensorMeta> metas)
      : Binder(addresses.size()), addresses_(addresses), metas_(metas) {}
  void operator()(const Slot& slot, Operand& operand) {
    std::size_t at = 0;
    if (advance(slot, at)) operand = {addresses_[at], &metas_[at]};
  }
  void optional_last(Slot slot, Operand& field) {
    slot.present = inputs_left();
    (*this)(slot, field);
  }

 private:
  std::span<void* const> addresses_;
  std::span<const TensorMeta> metas_;
};

class IndexBinder : public Binder {
 public:
  explicit IndexBinder(std::size_t input_count) : Binder(input_count) {}
  void operator()(const Slot& slot, int& index) {
    std::size_t at = 0;
    index = -1;
    if (!slot.present) return;
    advance(slot, at);
    index = static_cast<int>(at);
    if (slot.use == Use::kWrite) written.push_back(index);
  }
  void optional_last(Slot slot, int& field) {
    slot.present = inputs_left();
    (*this)(slot, field);
  }
  std::vector<int> written;
};

// The present operands' names, for a count error.
class Namer {
 public:
  template <typename F>
  void operator()(const Slot& slot, F&) {
    if (slot.present) names.push_back(slot_name(slot));
  }
  template <typename F>
  void optional_last(const Slot& slot, F&) {
    names.push_back(slot_name(slot) + " (optional)");
  }
  template <typename X>
  void list(std::string_view name, std::vector<X>& items, std::size_t count) {
    items.resize(count != kRestOfInputs ? count : 0);
    if (count == kRestOfInputs) rest = name;
  }
  std::vector<std::string> names;
  std::string_view rest;  // a list as long as the inputs left
};

// "op adamw takes 7 inputs (table, step, master[0], ...), got 6".
[[noreturn]] void throw_count(std::string_view op, const Namer& namer, std::size_t got);

}  // namespace operands_detail

// The program's inputs of one call, in visit order; Error naming the operand
// when a present one is undefined or an absent one is given.
template <template <typename> class Operands, typename Params>
std::vector<Tensor> flatten(std::string_view op, const Params& params, Operands<Tensor> operands) {
  operands_detail::Flattener flattener(op);
  visit_operands(params, operands, flattener);
  return flattener.take();
}

// The check's view of the inputs; Error naming the operands when the count is off.
template <template <typename> class Operands, typename Params>
Operands<TensorMeta> bind_metas(std::string_view op, const Params& params, std::span<const TensorMeta> inputs) {
  Operands<TensorMeta> operands;
  operands_detail::SpanBinder<TensorMeta> binder(inputs);
  visit_operands(params, operands, binder);
  if (binder.next() != inputs.size()) {
    operands_detail::Namer namer;
    Operands<TensorMeta> names;
    visit_operands(params, names, namer);
    operands_detail::throw_count(op, namer, inputs.size());
  }
  return operands;
}

// Binds a struct to addresses and their metas (a launcher's inputs or outputs).
template <template <typename> class Fields, typename Params>
Fields<Operand> bind_addresses(const Params& params, std::span<void* const> addresses,
                               std::span<const TensorMeta> metas) {
  Fields<Operand> fields;
  operands_detail::ArgBinder binder(addresses, metas);
  visit_operands(params, fields, binder);
  return fields;
}

// The launcher's view of the inputs (counted by the check before).
template <template <typename> class Operands, typename Params>
Operands<Operand> bind_args(const Params& params, const KernelArgs& args) {
  return bind_addresses<Operands>(params, args.inputs, args.input_metas);
}

// Named outputs (a struct visited like operands, all fields read): the
// launcher's view of the outputs, a check's list of output metas, and a
// call's results by name.
template <template <typename> class Outputs, typename Params>
Outputs<Operand> bind_outputs(const Params& params, const KernelArgs& args) {
  return bind_addresses<Outputs>(params, args.outputs, args.output_metas);
}

template <template <typename> class Outputs, typename Params>
std::vector<TensorMeta> output_metas(const Params& params, Outputs<TensorMeta> outputs) {
  operands_detail::Collector<TensorMeta> collector;
  visit_operands(params, outputs, collector);
  return std::move(collector.items);
}

template <template <typename> class Outputs, typename Params>
Outputs<Tensor> bind_results(const Params& params, std::span<const Tensor> results) {
  Outputs<Tensor> outputs;
  operands_detail::SpanBinder<Tensor> binder(results);
  visit_operands(params, outputs, binder);
  return outputs;
}

// Each operand's position among the inputs (-1 where absent), and the
// positions of those written in place, in visit order.
template <template <typename> class Operands>
struct OperandLayout {
  Operands<int> at;
  std::vector<int> written;
};

template <template <typename> class Operands, typename Params>
OperandLayout<Operands> operand_layout(const Params& params, std::size_t input_count) {
  OperandLayout<Operands> layout;
  operands_detail::IndexBinder binder(input_count);
  visit_operands(params, layout.at, binder);
  layout.written = std::move(binder.written);
  return layout;
}

// OpDef::mutated_inputs_for of an op with named operands.
template <template <typename> class Operands, typename Params>
std::vector<int> written_inputs_of(const OpParams& params, std::size_t input_count) {
  return operand_layout<Operands>(params.as<Params>(), input_count).written;
}

}  // namespace stepgraph::ops
