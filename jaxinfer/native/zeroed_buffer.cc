// A zeroed output buffer whose pages stay unallocated until first written:
// the KV pool's allocation (native/zeroed_buffer.py).
//
// jnp.zeros writes every byte, so a pool sized for many long sequences is
// resident in full from the start (hundreds of MB on CPU) and costs a pass
// over memory before the first token. Here the whole pages inside the buffer
// are handed back to the kernel with madvise(MADV_DONTNEED): for the private
// anonymous memory every malloc returns, the kernel then maps the shared zero
// page on read and a fresh zeroed page on first write, so the pool becomes
// resident only as blocks are used. The partial pages at either end (shared
// with other allocations) are zeroed with memset, and where madvise refuses
// the range, all of it is.

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error ZeroedBufferImpl(ffi::Result<ffi::AnyBuffer> out) {
  char* begin = static_cast<char*>(out->untyped_data());
  const size_t size = out->size_bytes();
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t first = (reinterpret_cast<uintptr_t>(begin) + page - 1) & ~(page - 1);
  const uintptr_t last = (reinterpret_cast<uintptr_t>(begin) + size) & ~(page - 1);
  if (last <= first || madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED) != 0) {
    std::memset(begin, 0, size);
    return ffi::Error::Success();
  }
  std::memset(begin, 0, first - reinterpret_cast<uintptr_t>(begin));
  std::memset(reinterpret_cast<char*>(last), 0, reinterpret_cast<uintptr_t>(begin) + size - last);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferZeroedBuffer, ZeroedBufferImpl, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());
