// Each csrc/bindings/<family>.cpp registers itself here with COAT_REGISTER_BINDINGS, so adding a
// family touches no shared file. module.cpp runs the registered functions in name order.
#pragma once

#include <nanobind/nanobind.h>

#include <map>
#include <string>

namespace coat {
namespace bind {

using RegisterFn = void (*)(nanobind::module_&);

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
