// ACL entry points that newer toolkits added, looked up at run time in the loaded ACL library instead of linked, so
// the NPU module builds and loads against an older toolkit too (and then takes the older path).
#ifndef LMCACHE_NPU_ACL_SYMBOLS_H_
#define LMCACHE_NPU_ACL_SYMBOLS_H_

#include <dlfcn.h>

#include "acl/acl.h"

namespace lmcache_npu {
namespace npu {

// The loaded library that defines ACL's runtime (libascendcl; in x86 tests, the fake device's module): found through
// a function every toolkit has, without loading anything.
inline void* AclLibrary() {
  static void* handle = [] {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&aclrtMalloc), &info) == 0 || info.dli_fname == nullptr) {
      return static_cast<void*>(nullptr);
    }
    return dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  }();
  return handle;
}

// `name` from that library as a `Fn`, or null when this toolkit lacks it.
template <typename Fn>
Fn OptionalAcl(const char* name) {
  void* library = AclLibrary();
  return library == nullptr ? nullptr : reinterpret_cast<Fn>(dlsym(library, name));
}

}  // namespace npu
}  // namespace lmcache_npu

#endif  // LMCACHE_NPU_ACL_SYMBOLS_H_
