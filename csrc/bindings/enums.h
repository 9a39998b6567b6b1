// The core's enums reach Python as module attributes, one name -> value dict each, exported once
// (csrc/bindings/enums.cpp; an enum private to one binding file, from that file). coat/_ops/enums.py
// is their one reader: no Python module copies an enum value.
#pragma once

#include <nanobind/nanobind.h>

#include <initializer_list>
#include <utility>

namespace coat {
namespace bind {

// {"name": int(E::kValue), ...} of an enum's values.
template <class E>
nanobind::dict enum_dict(std::initializer_list<std::pair<const char*, E>> values) {
  nanobind::dict d;
  for (const auto& [name, value] : values) d[name] = static_cast<int>(value);
  return d;
}

}  // namespace bind
}  // namespace coat
