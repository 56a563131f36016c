// Native core of lmcache-kv-fast: pybind11 bindings.
//
// Python passes raw addresses (tensor.data_ptr()) and sizes; every address range is
// validated here, with the GIL held, before the GIL is released for the copy itself.
// A tensor's size is the memory that backs it (the Python side bounds it by the
// tensor's storage); a tensor span that cannot hold the shape raises TensorSpanError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "amx_tiles.hpp"
#include "common.hpp"
#include "copy_kernels.hpp"
#include "fused_blocks.hpp"
#include "fused_rows.hpp"
#include "kv_copy.hpp"
#include "result_buffer.hpp"
#include "shm_mapping.hpp"
#include "index_rows.hpp"
#include "key_redundancy.hpp"
#include "key_scores.hpp"
#include "rope_gather.hpp"
#include "score_pool.hpp"
#include "window_scores.hpp"
#include "strided_copy.hpp"
#include "thread_pool.hpp"
#include "uffd_fill.hpp"

namespace py = pybind11;
using namespace pybind11::literals;

namespace lmckv {
namespace {

// Pins mappings for the duration of a copy; unpins (GIL held) on scope exit.
class PinSet {
 public:
  PinSet() = default;
  PinSet(const PinSet&) = delete;
  PinSet& operator=(const PinSet&) = delete;
  ~PinSet() {
    for (Mapping* m : pinned_) m->unpin();
  }
  // `obj` wraps `m`; the reference keeps the Mapping alive even if the caller's list
  // is mutated by another thread while the copy runs without the GIL.
  void add(py::object obj, Mapping* m) {
    if (seen_.insert(m).second) {
      m->pin();  // raises if closed
      pinned_.push_back(m);
      refs_.push_back(std::move(obj));
    }
  }

 private:
  std::vector<Mapping*> pinned_;
  std::vector<py::object> refs_;
  std::unordered_set<Mapping*> seen_;
};

uint64_t field(py::handle obj, const char* what) { return to_u64_nonneg(obj, what); }

// Check and pin the owners of regions (addrs[j], lens[j]): `owners` is None or one
// Mapping-or-None per region; a Mapping must be open and contain its region. Returns the
// owner of each region (nullptr: none). ValueError / TypeError "<op>: <kind> j ...".
std::vector<Mapping*> pin_owners(PinSet& pins, py::handle owners,
                                 const std::vector<int64_t>& addrs,
                                 const std::vector<int64_t>& lens, const std::string& op,
                                 const std::string& kind) {
  std::vector<Mapping*> owner_of(addrs.size(), nullptr);
  if (owners.is_none()) return owner_of;
  py::sequence seq = py::reinterpret_borrow<py::sequence>(owners);
  if (seq.size() != addrs.size()) {
    throw py::value_error(op + ": " + std::to_string(seq.size()) + " owners for " +
                          std::to_string(addrs.size()) + " " + kind + "s");
  }
  for (size_t j = 0; j < addrs.size(); ++j) {
    py::object o = seq[j];
    if (o.is_none()) continue;
    if (!py::isinstance<Mapping>(o)) {
      throw py::type_error(op + ": owner " + std::to_string(j) + " is not a Mapping or None");
    }
    Mapping* m = o.cast<Mapping*>();
    if (m->closed()) {
      throw py::value_error(op + ": " + kind + " " + std::to_string(j) +
                            " belongs to closed segment " + m->name());
    }
    if (!m->contains(static_cast<uintptr_t>(addrs[j]), static_cast<uint64_t>(lens[j]))) {
      throw py::value_error(op + ": " + kind + " " + std::to_string(j) +
                            " lies outside segment " + m->name());
    }
    pins.add(o, m);
    owner_of[j] = m;
  }
  return owner_of;
}

// A buffer span handed over as (base, nbytes, offset).
Span span_arg(py::handle obj, const char* what) {
  if (!py::isinstance<py::tuple>(obj) || py::len(obj) != 3) {
    throw py::type_error(std::string(what) + ": expected a (base, nbytes, offset) tuple");
  }
  auto t = py::reinterpret_borrow<py::tuple>(obj);
  return Span{field(t[0], what), field(t[1], what), field(t[2], what)};
}

EditDType edit_dtype(const std::string& name) {
  if (name == "float32") return EditDType::kF32;
  if (name == "bfloat16") return EditDType::kBF16;
  throw py::value_error("dtype must be 'float32' or 'bfloat16', got '" + name + "'");
}

KeyHeadsArgs key_heads_args(py::handle k, py::handle out, py::handle layers,
                            py::handle tokens, py::handle n_kv, py::handle head_dim) {
  KeyHeadsArgs a;
  a.k = span_arg(k, "k");
  a.out = span_arg(out, "out");
  a.layers = field(layers, "layers");
  a.tokens = field(tokens, "tokens");
  a.n_kv = field(n_kv, "n_kv");
  a.head_dim = field(head_dim, "head_dim");
  return a;
}

void bind_edit_kernels(py::module_& m) {
  m.def(
      "rope_gather",
      [](py::handle dst, py::handle src, py::handle idx, py::handle cos, py::handle sin,
         py::handle planes, py::handle layers, py::handle rows, py::handle n, py::handle width,
         py::handle head_dim, py::handle rotary_dim, bool interleaved, const std::string& dtype) {
        RopeGatherArgs a;
        a.dst = span_arg(dst, "dst");
        a.src = span_arg(src, "src");
        a.idx = span_arg(idx, "idx");
        a.cos = span_arg(cos, "cos");
        a.sin = span_arg(sin, "sin");
        a.planes = field(planes, "planes");
        a.layers = field(layers, "layers");
        a.rows = field(rows, "rows");
        a.n = field(n, "n");
        a.width = field(width, "width");
        a.head_dim = field(head_dim, "head_dim");
        a.rotary_dim = field(rotary_dim, "rotary_dim");
        a.interleaved = interleaved;
        a.dtype = edit_dtype(dtype);
        const RopeGatherPlan plan(a);
        py::gil_scoped_release nogil;
        plan.execute();
      },
      "dst"_a, "src"_a, "idx"_a, "cos"_a, "sin"_a, "planes"_a, "layers"_a, "rows"_a, "n"_a,
      "width"_a, "head_dim"_a, "rotary_dim"_a, "interleaved"_a, "dtype"_a,
      "dst[p][l][j] = src[p][l][idx[j]] with plane 0's rotary pairs turned by cos/sin[j] "
      "(spans are (base, nbytes, offset); ValueError before any byte moves).");
  m.def(
      "window_scores",
      [](py::handle q, py::handle k, py::handle out, py::handle layers, py::handle tokens,
         py::handle tq, py::handle n_kv, py::handle group, py::handle head_dim,
         py::handle window, bool at_end, float scale) {
        WindowScoresArgs a;
        a.q = span_arg(q, "q");
        a.k = span_arg(k, "k");
        a.out = span_arg(out, "out");
        a.layers = field(layers, "layers");
        a.tokens = field(tokens, "tokens");
        a.tq = field(tq, "tq");
        a.n_kv = field(n_kv, "n_kv");
        a.group = field(group, "group");
        a.head_dim = field(head_dim, "head_dim");
        a.window = field(window, "window");
        a.at_end = at_end;
        a.scale = scale;
        const WindowScoresPlan plan(a);
        py::gil_scoped_release nogil;
        plan.execute();
      },
      "q"_a, "k"_a, "out"_a, "layers"_a, "tokens"_a, "tq"_a, "n_kv"_a, "group"_a,
      "head_dim"_a, "window"_a, "at_end"_a, "scale"_a,
      "SnapKV's window attention summed over the window: out [L, Hq, T] float32 from bf16 "
      "q [L, tq, Hq*hd] and k [L, T, Hkv*hd] (ValueError before any work).");
  m.def(
      "score_pool",
      [](py::handle buf, py::handle rows, py::handle n, py::handle ld, py::handle kernel,
         bool is_max) {
        ScorePoolArgs a;
        a.buf = span_arg(buf, "buf");
        a.rows = field(rows, "rows");
        a.n = field(n, "n");
        a.ld = field(ld, "ld");
        a.kernel = field(kernel, "kernel");
        a.max = is_max;
        const ScorePoolPlan plan(a);
        py::gil_scoped_release nogil;
        plan.execute();
      },
      "buf"_a, "rows"_a, "n"_a, "ld"_a, "kernel"_a, "is_max"_a,
      "Pool the first n of each of `rows` float32 rows (ld apart) in place: max or mean "
      "within kernel // 2 (ValueError before any work).");
  m.def(
      "key_redundancy",
      [](py::handle k, py::handle out, py::handle layers, py::handle tokens, py::handle n_kv,
         py::handle head_dim, float threshold) {
        KeyRedundancyArgs a;
        a.heads = key_heads_args(k, out, layers, tokens, n_kv, head_dim);
        a.threshold = threshold;
        const KeyRedundancyPlan plan(a);
        py::gil_scoped_release nogil;
        plan.execute();
      },
      "k"_a, "out"_a, "layers"_a, "tokens"_a, "n_kv"_a, "head_dim"_a, "threshold"_a,
      "R-KV's redundancy sums: out [L, n_kv, T] float32 from bf16 k [L, T, n_kv*hd] "
      "(ValueError before any work; see key_redundancy_supported).");
  m.def("key_redundancy_supported", [](py::handle head_dim) {
    return KeyRedundancyPlan::supported(field(head_dim, "head_dim"));
  }, "head_dim"_a);
  m.def(
      "key_scores",
      [](py::handle k, py::handle out, py::handle layers, py::handle tokens, py::handle n_kv,
         py::handle head_dim, bool keydiff) {
        KeyScoresArgs a;
        a.heads = key_heads_args(k, out, layers, tokens, n_kv, head_dim);
        a.keydiff = keydiff;
        const KeyScoresPlan plan(a);
        py::gil_scoped_release nogil;
        plan.execute();
      },
      "k"_a, "out"_a, "layers"_a, "tokens"_a, "n_kv"_a, "head_dim"_a, "keydiff"_a,
      "KeyDiff (keydiff=True) or L2 scores out [L, n_kv, T] float32 from bf16 k [L, T, "
      "n_kv*hd] (ValueError before any work).");
  m.def(
      "window_scores_isa",
      [](py::handle head_dim) {
        return head_dim.is_none() ? window_scores_isa()
                                  : window_scores_isa(field(head_dim, "head_dim"));
      },
      "head_dim"_a = py::none(),
      "'amx', 'avx512' or 'generic': window_scores' path here (for keys of head_dim).");
  m.def("_set_window_scores_isa", &set_window_scores_isa, "name"_a);
  m.def(
      "_amx_tile_shapes",
      []() -> py::object {
        uint8_t cfg[64];
        if (!amx::loaded_shapes(cfg)) return py::none();
        return py::bytes(reinterpret_cast<const char*>(cfg), sizeof(cfg));
      },
      "The 64-byte tile configuration the CPU holds after the edit kernels' "
      "configure_tiles, or None without AMX (a self-check for the tests).");
}

// Share of the cold regions of a scatter written with pwritev (see execute_with_files):
// < 0 auto, 0 never, else that fraction (1: all of them).
std::atomic<double> g_cold_write_fraction{-1.0};
std::atomic<uint64_t> g_stat_file_bytes{0};    // scattered into segments with pwritev
std::atomic<uint64_t> g_stat_cold_mapped{0};   // scattered into cold pages via the mapping
std::atomic<uint64_t> g_stat_cold_regions{0};  // regions found cold
std::atomic<uint64_t> g_stat_file_fallbacks{0};  // scatters redone through the mapping
std::atomic<bool> g_file_writes_disabled{false};  // a file write failed (not ENOSPC)

// Relative throughputs into fresh tmpfs pages while both paths run at once (they share
// the kernel's page allocator and memory bandwidth): pwritev on the one thread the inode
// lock allows vs faulting copies per thread. Measured through ctx.store of 512 MiB into a
// punched pool on a 2-core VM, 2 x 6 reps, medians: fraction 0 290/281 ms, 0.5 220/227,
// 0.6 193/210, 0.75 184/195, 0.9 195/194, 1.0 225/198 -> 0.75 on 2 threads.
double auto_cold_write_fraction(int threads) {
  if (threads <= 1) return 1.0;
  constexpr double kWrite = 3.0;
  constexpr double kFault = 1.0;
  return kWrite / (kWrite + kFault * static_cast<double>(threads - 1));
}

std::atomic<uint64_t> g_stat_uffd_bytes{0};  // scattered into cold pages with UFFDIO_COPY

// Write the plan's ops with write(2) on their segment files (flat runs only): the path
// that reports a full file system as ENOSPC instead of SIGBUS. Returns the errno (0: ok).
int write_through_files(const std::vector<FillJob>& parts, const std::vector<Mapping*>& owner_of) {
  std::vector<FileWrite> files;
  uint64_t bytes = 0;
  for (const FillJob& p : parts) {
    Mapping* m = owner_of[static_cast<size_t>(p.tag)];
    files.push_back(FileWrite{m->fd(), reinterpret_cast<uintptr_t>(p.dst) - m->address(),
                              p.len, {iovec{const_cast<char*>(p.src), p.len}}});
    bytes += p.len;
  }
  const int err = execute_with_files(CopyPlan{}, files);
  if (err == 0) g_stat_file_bytes += bytes;
  return err;
}

// Scatter with the flat cold regions filled by UFFDIO_COPY (uffd_fill.hpp): their
// page-aligned interiors on the pool threads, then (after unregistering) everything else
// through the mapping. Returns false when userfaultfd cannot be used (nothing copied).
bool scatter_cold_uffd(const CopyPlan& plan, const std::vector<Mapping*>& owner_of,
                       const std::vector<int64_t>& addrs, const std::vector<int64_t>& lens,
                       const std::vector<char>& cold, const std::vector<char>& flat) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  auto up = [&](uint64_t a) { return (a + page - 1) / page * page; };
  auto down = [&](uint64_t a) { return a / page * page; };
  const size_t n = addrs.size();
  std::vector<std::pair<uintptr_t, uint64_t>> ranges;
  std::vector<char> use(n, 0);
  for (size_t j = 0; j < n; ++j) {
    if (!cold[j] || !flat[j]) continue;
    const uint64_t lo = up(static_cast<uint64_t>(addrs[j]));
    const uint64_t hi = down(static_cast<uint64_t>(addrs[j]) + static_cast<uint64_t>(lens[j]));
    if (hi > lo) {
      ranges.emplace_back(static_cast<uintptr_t>(lo), hi - lo);
      use[j] = 1;
    }
  }
  if (ranges.empty()) return false;
  // One registration per run of adjacent slots (each splits the mapping's VMA until it
  // is unregistered; a store's slots are usually contiguous).
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uintptr_t, uint64_t>> merged;
  for (const auto& r : ranges) {
    if (!merged.empty() && merged.back().first + merged.back().second == r.first) {
      merged.back().second += r.second;
    } else {
      merged.push_back(r);
    }
  }
  ranges.swap(merged);
  // Whole pages of each used region's runs are filled; the rest (partial pages, other
  // regions) is copied through the mapping once the ranges are unregistered.
  std::vector<FillJob> jobs;
  CopyPlan after;
  after.reserve(plan.size());
  uint64_t cold_mapped = 0;
  for (const CopyOp& op : plan.ops()) {
    const auto j = static_cast<size_t>(op.tag);
    const bool tagged = op.tag >= 0 && j < n;
    if (!tagged || !use[j]) {
      const bool c = tagged && cold[j];
      if (c) cold_mapped += op.rows * op.row_bytes;
      after.add(op.dst, op.src, op.rows, op.row_bytes, op.dst_pitch, op.src_pitch, op.tag, c);
      continue;
    }
    const auto d0 = reinterpret_cast<uintptr_t>(op.dst);
    const uint64_t lo = up(d0);
    const uint64_t hi = down(d0 + op.row_bytes);
    if (hi <= lo) {
      after.add(op.dst, op.src, 1, op.row_bytes, 0, 0, op.tag, true);
      cold_mapped += op.row_bytes;
      continue;
    }
    const uint64_t head = lo - d0;
    const uint64_t tail = d0 + op.row_bytes - hi;
    if (head) after.add(op.dst, op.src, 1, head, 0, 0, op.tag, true);
    jobs.push_back(FillJob{op.dst + head, op.src + head, hi - lo, op.tag});
    if (tail) after.add(op.dst + (hi - d0), op.src + (hi - d0), 1, tail, 0, 0, op.tag, true);
    cold_mapped += head + tail;
  }
  FillResult res;
  bool filled = false;
  int err = 0;
  {
    py::gil_scoped_release nogil;
    filled = uffd_fill(ranges, jobs, &res);
    if (filled) {
      if (res.err != 0) {
        // A failure other than "page already there" (e.g. no memory for the page): the
        // rest goes through write(2), which says ENOSPC where a fault would be SIGBUS.
        const int e = write_through_files(res.rest, owner_of);
        if (e == ENOSPC || e == EDQUOT) {
          err = e;
        } else if (e != 0) {  // the file refuses writes: through the mapping after all
          for (const FillJob& p : res.rest) after.add(p.dst, p.src, 1, p.len, 0, 0, p.tag, true);
        }
      } else {
        for (const FillJob& p : res.rest) after.add(p.dst, p.src, 1, p.len, 0, 0, p.tag, false);
      }
      after.execute();
    }
  }
  if (!filled) return false;
  g_stat_uffd_bytes += res.filled;
  g_stat_cold_mapped += cold_mapped;
  if (err != 0) {
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);
    throw py::error_already_set();
  }
  return true;
}

// Scatter `plan` (validated, regions pinned) with cold destination regions written
// through the segment file. Returns false when nothing is cold (caller runs the plan).
bool scatter_cold_aware(const CopyPlan& plan, const std::vector<Mapping*>& owner_of,
                        const std::vector<int64_t>& addrs, const std::vector<int64_t>& lens) {
  const double setting = g_cold_write_fraction.load();
  if (plan.sequential()) return false;
  const size_t n = addrs.size();
  std::vector<char> cold(n, 0);
  std::vector<char> flat(n, 1);  // every run of the region is one flat row
  for (const CopyOp& op : plan.ops()) {
    if (op.tag >= 0 && static_cast<size_t>(op.tag) < n && op.rows != 1) flat[op.tag] = 0;
  }
  size_t n_cold = 0;
  uint64_t cold_bytes = 0;
  for (size_t j = 0; j < n; ++j) {
    Mapping* m = owner_of[j];
    if (m != nullptr && m->fd() >= 0 &&
        m->cold(static_cast<uintptr_t>(addrs[j]), static_cast<uint64_t>(lens[j]))) {
      cold[j] = 1;
      ++n_cold;
      cold_bytes += static_cast<uint64_t>(lens[j]);
    }
  }
  if (n_cold == 0) return false;
  g_stat_cold_regions += n_cold;
  // Two or more threads: UFFDIO_COPY fills on all of them (one thread: write(2) is
  // faster). Not near a full file system, where only write(2) fails cleanly.
  if (get_threads() >= 2 && uffd_usable()) {
    bool room = true;
    std::vector<Mapping*> owners;
    for (size_t j = 0; j < n && room; ++j) {
      if (cold[j] && std::find(owners.begin(), owners.end(), owner_of[j]) == owners.end()) {
        owners.push_back(owner_of[j]);
        room = owner_of[j]->fs_free_bytes() >= cold_bytes + (64ull << 20);
      }
    }
    if (room && scatter_cold_uffd(plan, owner_of, addrs, lens, cold, flat)) return true;
  }
  double frac = setting < 0 ? auto_cold_write_fraction(get_threads()) : std::min(setting, 1.0);
  if (g_file_writes_disabled.load()) frac = 0.0;
  // Faulting a page into a full tmpfs raises SIGBUS; a write fails with ENOSPC instead.
  std::vector<Mapping*> seen;
  for (size_t j = 0; j < n && frac > 0.0; ++j) {
    if (cold[j] && std::find(seen.begin(), seen.end(), owner_of[j]) == seen.end()) {
      seen.push_back(owner_of[j]);
      if (owner_of[j]->fs_free_bytes() < cold_bytes + (64ull << 20)) frac = 1.0;
    }
  }
  // Which cold regions go through the file: evenly spread, `frac` of them.
  std::vector<char> by_file(n, 0);
  size_t k = 0;
  for (size_t j = 0; j < n; ++j) {
    if (!cold[j]) continue;
    // region k of the cold ones goes to the file when floor((k+1)f) > floor(kf)
    const auto before = static_cast<uint64_t>(static_cast<double>(k) * frac + 1e-9);
    const auto after = static_cast<uint64_t>(static_cast<double>(k + 1) * frac + 1e-9);
    by_file[j] = (after > before && flat[j]) ? 1 : 0;
    ++k;
  }
  CopyPlan mem;
  mem.reserve(plan.size());
  std::vector<FileWrite> files;
  uint64_t file_bytes = 0;
  uint64_t cold_mapped = 0;
  for (const CopyOp& op : plan.ops()) {
    const size_t j = static_cast<size_t>(op.tag);
    if (op.tag < 0 || j >= n || !by_file[j]) {
      const bool c = op.tag >= 0 && j < n && cold[j];
      if (c) cold_mapped += op.rows * op.row_bytes;
      mem.add(op.dst, op.src, op.rows, op.row_bytes, op.dst_pitch, op.src_pitch, op.tag, c);
      continue;
    }
    Mapping* m = owner_of[j];
    const uint64_t off = reinterpret_cast<uintptr_t>(op.dst) - m->address();
    if (files.empty() || files.back().fd != m->fd() ||
        files.back().offset + files.back().bytes != off) {
      files.push_back(FileWrite{m->fd(), off, 0, {}});
    }
    files.back().iov.push_back(iovec{const_cast<char*>(op.src), op.row_bytes});
    files.back().bytes += op.row_bytes;
    file_bytes += op.row_bytes;
  }
  int err = 0;
  {
    py::gil_scoped_release nogil;
    err = execute_with_files(mem, files);
  }
  g_stat_file_bytes += file_bytes;
  g_stat_cold_mapped += cold_mapped;
  if (err == ENOSPC || err == EDQUOT) {  // faulting those pages in would raise SIGBUS
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);
    throw py::error_already_set();
  }
  if (err != 0) {
    // The file refuses writes (another file system, a policy): copy everything through
    // the mapping instead, and stop trying files in this process.
    g_file_writes_disabled.store(true);
    g_stat_file_fallbacks += 1;
    py::gil_scoped_release nogil;
    plan.execute();
  }
  return true;
}

void kv_copy(bool to_regions, py::handle tensor_ptr, py::handle tensor_nbytes, py::handle shape,
             py::handle itemsize, py::handle width, py::handle col_offset,
             py::handle chunk_tokens, py::handle chunk_ids, py::handle region_addrs,
             py::handle region_nbytes, py::handle owners) {
  const char* op = to_regions ? "scatter" : "gather";
  const std::vector<int64_t> dims = to_i64_vector(shape, "shape");
  if (dims.size() != 4) {
    throw py::value_error(std::string(op) + ": shape must be (P, L, T, Dfull)");
  }
  for (int64_t d : dims) {
    if (d < 0) throw py::value_error(std::string(op) + ": negative dimension in shape");
  }
  KvGeometry g{};
  g.planes = static_cast<uint64_t>(dims[0]);
  g.layers = static_cast<uint64_t>(dims[1]);
  g.tokens = static_cast<uint64_t>(dims[2]);
  g.dfull = static_cast<uint64_t>(dims[3]);
  g.itemsize = field(itemsize, "itemsize");
  g.width = field(width, "width");
  g.col_offset = field(col_offset, "col_offset");
  g.chunk_tokens = field(chunk_tokens, "chunk_tokens");
  const uint64_t tptr = field(tensor_ptr, "tensor_ptr");
  const uint64_t tbytes = field(tensor_nbytes, "tensor_nbytes");
  const std::vector<int64_t> ids = to_i64_vector(chunk_ids, "chunk id");
  const std::vector<int64_t> addrs = to_i64_vector(region_addrs, "region address");
  const std::vector<int64_t> lens = to_i64_vector(region_nbytes, "region length");

  CopyPlan plan = plan_kv_copy(to_regions, static_cast<uintptr_t>(tptr), tbytes, g, ids,
                               addrs, lens);

  PinSet pins;
  const std::vector<Mapping*> owner_of = pin_owners(pins, owners, addrs, lens, op, "region");
  if (!owners.is_none() && to_regions && scatter_cold_aware(plan, owner_of, addrs, lens)) return;
  py::gil_scoped_release nogil;
  plan.execute();
}

// Writing through a mapping into pages a full tmpfs cannot allocate raises SIGBUS: before
// the regions' cold (not yet allocated) pages are written in place, their file system must
// have room for them plus a margin, else OSError(ENOSPC) and nothing is written.
std::atomic<uint64_t> g_cold_room_margin{64ull << 20};  // test hook: _set_cold_room_margin

void require_room_for_cold(const std::vector<Mapping*>& owner_of,
                           const std::vector<int64_t>& addrs, const std::vector<int64_t>& lens) {
  std::vector<std::pair<Mapping*, uint64_t>> cold;  // per mapping: cold bytes
  for (size_t j = 0; j < owner_of.size(); ++j) {
    Mapping* m = owner_of[j];
    if (m == nullptr || !m->cold(static_cast<uintptr_t>(addrs[j]), static_cast<uint64_t>(lens[j]))) {
      continue;
    }
    auto it = std::find_if(cold.begin(), cold.end(), [m](const auto& e) { return e.first == m; });
    if (it == cold.end()) it = cold.insert(cold.end(), {m, 0});
    it->second += static_cast<uint64_t>(lens[j]);
  }
  for (const auto& [m, bytes] : cold) {
    const uint64_t margin = g_cold_room_margin.load();
    if (m->fs_free_bytes() < bytes + margin || bytes + margin < bytes) {
      errno = ENOSPC;
      PyErr_SetFromErrno(PyExc_OSError);
      throw py::error_already_set();
    }
  }
}

// The regions, ids, index and tables every fused gather takes (fused_chunks.hpp), from
// Python; the caller reads its geometry next, then read_rotation_args.
void read_fused_args(FusedChunkArgs& a, py::handle src_addrs, py::handle src_nbytes,
                     py::handle dst_ids, py::handle dst_addrs, py::handle dst_nbytes,
                     py::handle idx, py::handle n_out, py::handle cos, py::handle sin) {
  a.src_addrs = to_i64_vector(src_addrs, "source region address");
  a.src_nbytes = to_i64_vector(src_nbytes, "source region length");
  a.dst_ids = to_i64_vector(dst_ids, "destination chunk id");
  a.dst_addrs = to_i64_vector(dst_addrs, "destination region address");
  a.dst_nbytes = to_i64_vector(dst_nbytes, "destination region length");
  a.idx = span_arg(idx, "idx");
  a.cos = span_arg(cos, "cos");
  a.sin = span_arg(sin, "sin");
  a.n_out = field(n_out, "n_out");
}

void read_rotation_args(FusedChunkArgs& a, py::handle head_dim, py::handle rotary_dim,
                        bool interleaved, const std::string& dtype) {
  a.head_dim = field(head_dim, "head_dim");
  a.rotary_dim = field(rotary_dim, "rotary_dim");
  a.interleaved = interleaved;
  if (a.rotary_dim) a.dtype = edit_dtype(dtype);
}

// `n` integers >= 0 (ValueError "<op>: geometry must be <n> integers >= 0 (<names>)").
std::vector<uint64_t> geometry_arg(py::handle geometry, size_t n, const std::string& op,
                                   const std::string& names) {
  const std::vector<int64_t> geo = to_i64_vector(geometry, "geometry");
  if (geo.size() != n || *std::min_element(geo.begin(), geo.end()) < 0) {
    throw py::value_error(op + ": geometry must be " + std::to_string(n) +
                          " integers >= 0 (" + names + ")");
  }
  return std::vector<uint64_t>(geo.begin(), geo.end());
}

// Run a validated fused plan: pin both sides' owners, refuse cold destination pages a
// full file system cannot back (ENOSPC, not SIGBUS), then execute without the GIL.
template <typename Plan>
void run_fused(const Plan& plan, const FusedChunkArgs& a, py::handle src_owners,
               py::handle dst_owners, const char* op) {
  PinSet pins;
  pin_owners(pins, src_owners, a.src_addrs, a.src_nbytes, op, "source region");
  const std::vector<Mapping*> dst_of =
      pin_owners(pins, dst_owners, a.dst_addrs, a.dst_nbytes, op, "destination region");
  require_room_for_cold(dst_of, a.dst_addrs, a.dst_nbytes);
  py::gil_scoped_release nogil;
  plan.execute();
}

void bind_fused_rows(py::module_& m) {
  m.def(
      "fused_rows",
      [](py::handle src_addrs, py::handle src_nbytes, py::handle src_owners, py::handle dst_ids,
         py::handle dst_addrs, py::handle dst_nbytes, py::handle dst_owners, py::handle idx,
         py::handle n_out, py::handle geometry, py::handle cos, py::handle sin,
         py::handle head_dim, py::handle rotary_dim, bool interleaved, const std::string& dtype) {
        FusedRowsArgs a;
        read_fused_args(a, src_addrs, src_nbytes, dst_ids, dst_addrs, dst_nbytes, idx, n_out,
                        cos, sin);
        const std::vector<uint64_t> geo = geometry_arg(
            geometry, 5, "fused_rows", "planes, layers, chunk_tokens, width, itemsize");
        a.planes = geo[0];
        a.layers = geo[1];
        a.chunk_tokens = geo[2];
        a.width = geo[3];
        a.itemsize = geo[4];
        read_rotation_args(a, head_dim, rotary_dim, interleaved, dtype);
        const FusedRowsPlan plan(a);
        run_fused(plan, a, src_owners, dst_owners, "fused_rows");
      },
      "src_addrs"_a, "src_nbytes"_a, "src_owners"_a, "dst_ids"_a, "dst_addrs"_a,
      "dst_nbytes"_a, "dst_owners"_a, "idx"_a, "n_out"_a, "geometry"_a, "cos"_a, "sin"_a,
      "head_dim"_a, "rotary_dim"_a, "interleaved"_a, "dtype"_a,
      "dst[j][p][l][r] = src[i // C][p][l][i % C] with i = idx[dst_ids[j] * C + r], plane 0 "
      "re-rotated by cos/sin of that output token when rotary_dim > 0 (spans are (base, "
      "nbytes, offset); ValueError before any byte moves).");
}

void bind_fused_blocks(py::module_& m) {
  m.def(
      "fused_blocks",
      [](py::handle src_addrs, py::handle src_nbytes, py::handle src_owners, py::handle dst_ids,
         py::handle dst_addrs, py::handle dst_nbytes, py::handle dst_owners, py::handle idx,
         py::handle n_out, py::handle geometry, py::handle tok_off, py::handle dim_off,
         py::handle cos, py::handle sin, py::handle head_dim, py::handle rotary_dim,
         bool interleaved, const std::string& dtype) {
        FusedBlocksArgs a;
        read_fused_args(a, src_addrs, src_nbytes, dst_ids, dst_addrs, dst_nbytes, idx, n_out,
                        cos, sin);
        const std::vector<uint64_t> geo = geometry_arg(
            geometry, 6, "fused_blocks",
            "layers, chunk_tokens, width, itemsize, block_size, head_size");
        a.layers = geo[0];
        a.chunk_tokens = geo[1];
        a.width = geo[2];
        a.itemsize = geo[3];
        a.block_size = geo[4];
        a.head_size = geo[5];
        read_rotation_args(a, head_dim, rotary_dim, interleaved, dtype);
        a.tok_off = to_i64_vector(tok_off, "tok_off");
        a.dim_off = to_i64_vector(dim_off, "dim_off");
        const FusedBlocksPlan plan(a);
        run_fused(plan, a, src_owners, dst_owners, "fused_blocks");
      },
      "src_addrs"_a, "src_nbytes"_a, "src_owners"_a, "dst_ids"_a, "dst_addrs"_a,
      "dst_nbytes"_a, "dst_owners"_a, "idx"_a, "n_out"_a, "geometry"_a, "tok_off"_a,
      "dim_off"_a, "cos"_a, "sin"_a, "head_dim"_a, "rotary_dim"_a, "interleaved"_a, "dtype"_a,
      "fused_rows for a CPU engine's raw [L, C, W] chunk objects: element (p, l, t, h, d) at "
      "l*C*W + (t//BS)*BS*W + h*2*HS + tok_off[p][t%BS] + dim_off[p][d] (geometry = (L, C, W, "
      "itemsize, BS, HS); tables flat, row-major); ValueError before any byte moves.");
  m.def("fused_blocks_isa", &fused_blocks_isa,
        "'avx512' when fused_blocks moves runs of consecutive tokens (K of vec / vec16) by "
        "AVX-512 lane groups here, else 'generic' (token by token).");
  m.def("_set_fused_blocks_isa", &set_fused_blocks_isa, "name"_a,
        "Testing only: force fused_blocks' path ('avx512', 'generic' or back to 'auto').");
}

// ValueError unless every page of [addr, addr + len) is mapped: msync(MS_ASYNC) only
// walks the process's mappings (ENOMEM on a hole) and starts no I/O.
void check_mapped(uint64_t addr, uint64_t len, const char* what) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t lo = addr / page * page;
  const uint64_t hi = checked_add(addr, len, what);
  if (msync(reinterpret_cast<void*>(lo), hi - lo, MS_ASYNC) != 0) {
    throw py::value_error(std::string(what) + ": [" + std::to_string(addr) + ", +" +
                          std::to_string(len) + ") is not (entirely) mapped memory");
  }
}

void parallel_memcpy(py::handle dst, py::handle src, py::handle n) {
  const uint64_t d = field(dst, "dst");
  const uint64_t s = field(src, "src");
  const uint64_t len = field(n, "n");
  if (len == 0) return;
  if (d == 0 || s == 0) throw py::value_error("memcpy: null address");
  (void)checked_add(d, len, "memcpy");
  (void)checked_add(s, len, "memcpy");
  if (d < s + len && s < d + len) throw py::value_error("memcpy: overlapping ranges");
  // Nothing tells the core what backs raw addresses; at least an unmapped range (a freed
  // large buffer) is refused instead of faulting.
  check_mapped(d, len, "memcpy dst");
  check_mapped(s, len, "memcpy src");
  CopyPlan plan;
  plan.add(reinterpret_cast<char*>(d), reinterpret_cast<const char*>(s), 1, len, 0, 0);
  py::gil_scoped_release nogil;
  plan.execute();
}

std::unique_ptr<ResultBuffer> make_buffer(py::handle nbytes, const std::string& prefault,
                                          bool pool) {
  const uint64_t n = field(nbytes, "nbytes");
  if (n == 0) throw py::value_error("ResultBuffer: nbytes must be >= 1");
  if (n > (1ull << 46)) throw py::value_error("ResultBuffer: nbytes too large");
  const Prefault pf = parse_prefault(prefault);
  py::gil_scoped_release nogil;
  return std::make_unique<ResultBuffer>(n, pf, pool);
}

py::dict pool_stats() {
  const ResultPoolStats s = result_pool_stats();
  return py::dict("limit"_a = s.limit, "pooled_bytes"_a = s.pooled_bytes, "entries"_a = s.entries,
                  "hits"_a = s.hits, "misses"_a = s.misses, "evictions"_a = s.evictions,
                  "reserved"_a = s.reserved);
}

py::dict config() {
  return py::dict("threads"_a = get_threads(), "parallel_threshold"_a = get_parallel_threshold(),
                  "copy_kernel"_a = kernel_name(get_kernel()),
                  "stream_threshold"_a = get_stream_threshold(), "stream_isa"_a = stream_isa(),
                  "stream_interleave"_a = get_stream_interleave(),
                  "usable_cpus"_a = usable_cpus());
}

}  // namespace
}  // namespace lmckv

PYBIND11_MODULE(_native, m) {
  using namespace lmckv;
  m.doc() = "lmcache-kv-fast native core: SHM mapping, parallel chunk scatter/gather, "
            "result buffers";
  m.attr("__version__") = "0.1.0";
  m.attr("MAX_THREADS") = kMaxThreads;
  install_fork_handlers();
  py::register_exception<TensorSpanError>(m, "TensorSpanError", PyExc_ValueError);

  py::class_<Mapping>(m, "Mapping")
      .def(py::init([](const std::string& name, std::optional<py::int_> size,
                       const std::string& populate) {
             int64_t min_size = -1;
             if (size.has_value()) {
               min_size = to_i64(*size, "size");
               if (min_size < 0) throw py::value_error("size must be >= 0");
             }
             return std::make_unique<Mapping>(name, min_size, populate);
           }),
           "name"_a, "size"_a = py::none(), "populate"_a = "auto")
      .def_property_readonly("name", &Mapping::name)
      .def_property_readonly("size", &Mapping::size)
      .def_property_readonly("address", &Mapping::address)
      .def_property_readonly("closed", &Mapping::closed)
      .def_property_readonly("populate", &Mapping::populate_used)
      .def_property_readonly("populate_seconds", &Mapping::populate_seconds)
      .def(
          "regions",
          [](const Mapping& self, py::handle offsets, py::handle lengths,
             py::handle expected_nbytes, py::handle align) {
            if (self.closed()) throw py::value_error("segment " + self.name() + " is closed");
            const std::vector<int64_t> offs = to_i64_vector(offsets, "slot offset");
            const std::vector<int64_t> lens = to_i64_vector(lengths, "slot length");
            return self.regions(offs, lens, to_i64(expected_nbytes, "expected_nbytes"),
                                to_i64(align, "align"));
          },
          "offsets"_a, "lengths"_a, "expected_nbytes"_a, "align"_a)
      .def(
          "populate_resident",
          [](Mapping& self, py::handle offset, py::handle length) {
            const uint64_t off = field(offset, "offset");
            const uint64_t len = field(length, "length");
            if (off > self.size() || len > self.size() - off) {
              throw py::value_error("populate_resident: [" + std::to_string(off) + ", +" +
                                    std::to_string(len) + ") outside the " +
                                    std::to_string(self.size()) + "-byte segment");
            }
            self.pin();  // ValueError if closed; close() now waits for this call
            uint64_t pages = 0;
            {
              py::gil_scoped_release nogil;
              pages = self.populate_resident_range(off, len);
            }
            self.unpin();
            return pages;
          },
          "offset"_a, "length"_a,
          "Map the already-allocated pages of [offset, offset + length) (no fault on the "
          "next copy into them); returns the pages mapped.")
      .def(
          "cold",
          [](Mapping& self, py::handle addr, py::handle nbytes) {
            const uint64_t a = field(addr, "addr");
            const uint64_t n = field(nbytes, "nbytes");
            self.pin();  // ValueError if closed; close() now waits for this call
            const bool c = self.cold(static_cast<uintptr_t>(a), n);
            self.unpin();
            return c;
          },
          "addr"_a, "nbytes"_a,
          "Whether most of [addr, addr + nbytes) has no page in the segment yet (sampled "
          "with mincore; False outside the mapping): a write there allocates every page.")
      .def("close", &Mapping::close)
      .def("__enter__", [](Mapping& self) -> Mapping& { return self; },
           py::return_value_policy::reference)
      .def("__exit__", [](Mapping& self, py::args) { self.close(); })
      .def("__repr__", [](const Mapping& self) {
        return "<_native.Mapping name='" + self.name() + "' size=" + std::to_string(self.size()) +
               (self.closed() ? " closed>" : ">");
      });

  py::class_<ResultBuffer>(m, "ResultBuffer", py::buffer_protocol())
      .def(py::init(&make_buffer), "nbytes"_a, "prefault"_a = "auto", "pool"_a = true)
      .def_property_readonly("nbytes", &ResultBuffer::nbytes)
      .def_property_readonly("capacity", &ResultBuffer::capacity)
      .def_property_readonly("recycled", &ResultBuffer::recycled)
      .def_property_readonly("address",
                             [](const ResultBuffer& b) {
                               return reinterpret_cast<uintptr_t>(b.data());
                             })
      .def_buffer([](ResultBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes())}, {1}, false);
      });

  // scatter and gather share one signature; only the direction differs.
  auto kv_binding = [](bool to_regions) {
    return [to_regions](py::handle tensor_ptr, py::handle tensor_nbytes, py::handle shape,
                        py::handle itemsize, py::handle width, py::handle col_offset,
                        py::handle chunk_tokens, py::handle chunk_ids, py::handle region_addrs,
                        py::handle region_nbytes, py::handle owners) {
      kv_copy(to_regions, tensor_ptr, tensor_nbytes, shape, itemsize, width, col_offset,
              chunk_tokens, chunk_ids, region_addrs, region_nbytes, owners);
    };
  };
  for (const bool to_regions : {true, false}) {
    m.def(to_regions ? "scatter" : "gather", kv_binding(to_regions), "tensor_ptr"_a,
          "tensor_nbytes"_a, "shape"_a, "itemsize"_a, "width"_a, "col_offset"_a,
          "chunk_tokens"_a, "chunk_ids"_a, "region_addrs"_a, "region_nbytes"_a,
          "owners"_a = py::none(),
          to_regions ? "Copy chunk chunk_ids[j] of the [P, L, T, Dfull] tensor into region j."
                     : "Copy region j into chunk chunk_ids[j] of the [P, L, T, Dfull] tensor.");
  }
  m.def("memcpy", &parallel_memcpy, "dst"_a, "src"_a, "n"_a,
        "Parallel copy of n bytes between raw addresses (benchmark roofline helper, not "
        "used by the SDK). Refuses null, overlapping or unmapped ranges; otherwise "
        "UNCHECKED: the caller guarantees both ranges belong to live, writable buffers.");
  m.def(
      "strided_copy",
      [](py::handle dst, py::handle dst_nbytes, py::handle dst_offset, py::handle src,
         py::handle src_nbytes, py::handle src_offset, py::handle itemsize, py::handle sizes,
         py::handle dst_strides, py::handle src_strides) {
        const StridedPlan plan = plan_strided_copy(
            field(dst, "dst"), field(dst_nbytes, "dst_nbytes"), field(dst_offset, "dst_offset"),
            field(src, "src"), field(src_nbytes, "src_nbytes"), field(src_offset, "src_offset"),
            field(itemsize, "itemsize"), to_i64_vector(sizes, "sizes"),
            to_i64_vector(dst_strides, "dst_strides"), to_i64_vector(src_strides, "src_strides"));
        py::gil_scoped_release nogil;
        execute_strided_copy(plan);
      },
      "dst"_a, "dst_nbytes"_a, "dst_offset"_a, "src"_a, "src_nbytes"_a, "src_offset"_a,
      "itemsize"_a, "sizes"_a, "dst_strides"_a, "src_strides"_a,
      "Copy the strided view (src + src_offset elements, src_strides) into the view of dst "
      "(same sizes; element strides/offsets); every element of both views is checked to lie "
      "in its buffer [addr, addr + nbytes), and the buffers must not overlap.");

  m.def(
      "index_rows",
      [](py::handle dst, py::handle dst_nbytes, py::handle dst_offset, py::handle src,
         py::handle src_nbytes, py::handle src_offset, py::handle idx, py::handle idx_nbytes,
         py::handle idx_offset, py::handle idx_itemsize, py::handle n_idx, py::handle outer,
         py::handle rows, py::handle row_bytes) {
        IndexRowsArgs a;
        a.dst = field(dst, "dst");
        a.dst_nbytes = field(dst_nbytes, "dst_nbytes");
        a.dst_offset = field(dst_offset, "dst_offset");
        a.src = field(src, "src");
        a.src_nbytes = field(src_nbytes, "src_nbytes");
        a.src_offset = field(src_offset, "src_offset");
        a.idx = field(idx, "idx");
        a.idx_nbytes = field(idx_nbytes, "idx_nbytes");
        a.idx_offset = field(idx_offset, "idx_offset");
        a.idx_itemsize = field(idx_itemsize, "idx_itemsize");
        a.n_idx = field(n_idx, "n_idx");
        a.outer = field(outer, "outer");
        a.rows = field(rows, "rows");
        a.row_bytes = field(row_bytes, "row_bytes");
        const CopyPlan plan = plan_index_rows(a);
        py::gil_scoped_release nogil;
        plan.execute();
      },
      "dst"_a, "dst_nbytes"_a, "dst_offset"_a, "src"_a, "src_nbytes"_a, "src_offset"_a,
      "idx"_a, "idx_nbytes"_a, "idx_offset"_a, "idx_itemsize"_a, "n_idx"_a, "outer"_a,
      "rows"_a, "row_bytes"_a,
      "dst[o][i] = src[o][index[i]] for [outer, rows, row_bytes] src and [outer, n_idx, "
      "row_bytes] dst (byte offsets into buffers of *_nbytes); every index must lie in "
      "[0, rows), every span in its buffer, and the buffers must not overlap (ValueError, "
      "before any byte moves).");

  bind_edit_kernels(m);
  bind_fused_rows(m);
  bind_fused_blocks(m);
  m.def("set_threads", &set_threads, "n"_a);
  m.def("get_threads", &get_threads);
  m.def("set_call_threads", &set_call_threads, "n"_a);
  m.def("get_call_threads", &get_call_threads);
  m.def("set_parallel_threshold",
        [](py::handle n) { set_parallel_threshold(field(n, "threshold")); }, "nbytes"_a);
  m.def("get_parallel_threshold", &get_parallel_threshold);
  m.def("set_copy_kernel", [](const std::string& k) { set_kernel(parse_kernel(k)); }, "name"_a);
  m.def("get_copy_kernel", [] { return kernel_name(get_kernel()); });
  m.def("set_stream_threshold",
        [](py::handle n) { set_stream_threshold(field(n, "threshold")); }, "nbytes"_a);
  m.def("get_stream_threshold", &get_stream_threshold);
  m.def("set_stream_interleave", &set_stream_interleave, "pages"_a,
        "Streaming copies walk this many 4 KiB pages in lock step (1: linear), 1..64.");
  m.def("get_stream_interleave", &get_stream_interleave);
  m.def("config", &config);
  m.def("set_cold_write_fraction",
        [](double f) {
          if (!(f == -1.0 || (f >= 0.0 && f <= 1.0))) {
            throw py::value_error("cold write fraction must be -1 (auto) or in [0, 1], got " +
                                  std::to_string(f));
          }
          g_cold_write_fraction.store(f);
        },
        "fraction"_a,
        "Share of a scatter's not-yet-allocated segment regions written with pwritev "
        "instead of through the mapping: -1 auto (by thread count), 0 never, 1 all.");
  m.def("get_cold_write_fraction", [] { return g_cold_write_fraction.load(); });
  m.def("copy_stats", [] {
    py::dict d;
    d["file_write_bytes"] = g_stat_file_bytes.load();
    d["cold_mapped_bytes"] = g_stat_cold_mapped.load();
    d["cold_regions"] = g_stat_cold_regions.load();
    d["file_write_fallbacks"] = g_stat_file_fallbacks.load();
    d["file_writes_disabled"] = g_file_writes_disabled.load() ? 1 : 0;
    d["uffd_fill_bytes"] = g_stat_uffd_bytes.load();
    d["uffd_unavailable"] = uffd_unavailable() ? 1 : 0;
    d["staged_box_bytes"] = staged_box_bytes();
    d["staged_box_direct_bytes"] = staged_box_direct_bytes();
    d["pool_jobs"] = pool_jobs();
    d["fused_block_tables"] = fused_block_tables_planned();
    return d;
  });
  m.def("set_cold_uffd", &set_uffd_enabled, "enabled"_a,
        "Fill a scatter's not-yet-allocated segment pages with UFFDIO_COPY on the copy "
        "threads (default on; used with >= 2 threads where userfaultfd is available). "
        "Enabling also retries a userfaultfd found unusable before.");
  m.def("get_cold_uffd", &uffd_enabled);
  m.def("_set_uffd_fault",
        [](int err) {
          if (err < 0) throw py::value_error("errno must be >= 0");
          set_uffd_fault(err);
        },
        "err"_a,
        "Testing only: every UFFDIO_COPY places half of its pages, then fails with errno "
        "`err` (0: off).");
  m.def("_set_box_staging_fault", &set_box_staging_fault, "on"_a,
        "Testing only: strided copies get no staging buffer for their boxes (their tiles "
        "then run in place).");
  m.def(
      "_set_cold_room_margin",
      [](py::handle n) { return g_cold_room_margin.exchange(field(n, "margin")); }, "margin"_a,
      "Test hook: free bytes fused_rows / fused_blocks want beyond a region's cold pages "
      "(default 64 MiB); returns the previous value.");
  m.def("_set_file_write_fault",
        [](int err) {
          if (err < 0) throw py::value_error("errno must be >= 0");
          set_file_write_fault(err);
          if (err == 0) g_file_writes_disabled.store(false);
        },
        "err"_a,
        "Testing only: make every pwritev of a cold scatter fail with errno `err` (0: off, "
        "which also re-enables file writes after a fallback).");

  m.def("result_pool_stats", &pool_stats);
  m.def("set_result_pool_limit",
        [](py::handle n) { set_result_pool_limit(field(n, "limit")); }, "nbytes"_a);
  m.def("result_pool_trim", &result_pool_trim);
  m.def(
      "result_pool_reserve",
      [](py::handle nbytes, py::handle count) {
        const uint64_t n = field(nbytes, "nbytes");
        const uint64_t c = field(count, "count");
        if (n > (1ull << 46)) throw py::value_error("result_pool_reserve: nbytes too large");
        if (c > 4096) throw py::value_error("result_pool_reserve: count above 4096");
        py::gil_scoped_release nogil;
        return result_pool_reserve(n, c);
      },
      "nbytes"_a, "count"_a);
  m.def("validate_segment_name", &validate_segment_name, "name"_a);
}
