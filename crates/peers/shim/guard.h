// What every shim's C functions do around the peers' C++: return 0, or -1 with the exception's
// message in `err`, so that no C++ exception crosses into Rust.
#pragma once

#include <cstdio>
#include <exception>

namespace peers_shim {

inline void set_error(char* err, size_t len, const char* what) {
  if (err && len) snprintf(err, len, "%s", what);
}

template <typename F>
int guarded(char* err, size_t len, F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    set_error(err, len, e.what());
  } catch (...) {
    set_error(err, len, "unknown C++ exception");
  }
  return -1;
}

}  // namespace peers_shim
