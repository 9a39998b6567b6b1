// Each csrc/bindings/<family>.cpp registers itself here with COAT_REGISTER_BINDINGS, so adding a
// family touches no shared file. module.cpp runs the registered functions in name order.
#pragma once

#include <nanobind/nanobind.h>

#include <map>
#include <string>

#include "coat/common.h"

namespace coat {
namespace bind {

using RegisterFn = void (*)(nanobind::module_&);

// Every binding is defined with this guard (m.def(name, fn, restore_device(), args...)): bindings
// make a tensor's device current before they touch it, and the guard puts the caller's back.
inline auto restore_device() { return nanobind::call_guard<::coat::DeviceRestore>(); }

inline std::map<std::string, RegisterFn>& registry() {
  static std::map<std::string, RegisterFn> r;
  return r;
}

struct Registrar {
  Registrar(const char* name, RegisterFn fn) { registry()[name] = fn; }
};

}  // namespace bind
}  // namespace coat

#define COAT_REGISTER_BINDINGS(family, fn) \
  static ::coat::bind::Registrar coat_bindings_registrar_##family(#family, fn)
