"""Native CPU kernels, compiled on first use for this machine and cached.

`qmatmul(x, w, qtype, bias)` multiplies float32 activations by a weight matrix kept in a GGUF
block format (see qmatmul.cpp). It is built with torch's C++ extension machinery and
`-march=native` (AVX2 paths on x86; a portable fallback elsewhere) into
``$SPECSERVE_CACHE/kernels/<key>`` where the key covers the source, torch (version and install)
and CPU, so a cache shared between machines never hands one a binary built for another; the
source is compiled from a copy in that directory, so checkouts with the same source share it. The first build
takes about a minute; later processes load it in milliseconds.

The kernels prefetch weight blocks some distance ahead of the one they read (into L2). The best
distance is a property of the machine (2 KiB on one 2-vCPU Xeon VM, 4 KiB on an Emerald Rapids
one, each ~10% better than the other's choice), and passes over several activation rows (verify
passes, batched decoding, prompts) want a longer one than one-row decode passes (8 KiB against
3-4 KiB on a Zen 5). So the first model of a process large enough to stream from DRAM picks both
by timing its own forwards of 1 token, and of 2 and 5 tokens (`tune_prefetch`). ``$SPECSERVE_PREFETCH=<bytes>``
pins both instead, ``<one-row>,<multi-row>`` each (0 turns prefetching off).

``$SPECSERVE_MARCH`` replaces ``native`` in ``-march=``: ``x86-64-v3`` builds the AVX2 kernels an
AVX2-only CPU runs (no AVX-512, no VNNI), to measure or test that path on a newer machine. Each
target gets its own build directory.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
import platform
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, TypeVar

import torch

from specserve.errors import ConfigError, SpecServeError

if TYPE_CHECKING:
    from specserve.startup_cache import StartupCache

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("qmatmul.cpp")
_LOCK = threading.Lock()
_loaded: ModuleType | None = None  # the kernel module once this process has built or loaded it

# GGML tensor types the kernel reads directly (gguf.GGMLQuantizationType values).
KERNEL_QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
# (values, bytes) per block of each type.
BLOCK_SHAPES = {2: (32, 18), 3: (32, 20), 6: (32, 22), 8: (32, 34), 12: (256, 144), 14: (256, 210)}


class KernelBuildError(SpecServeError):
    """The native kernel could not be compiled or loaded on this machine."""


def _cpu_key() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    flags += line
    except OSError:
        pass
    return platform.machine() + flags


def _march() -> str:
    """The compiler's -march target: $SPECSERVE_MARCH, or native."""
    march = os.environ.get("SPECSERVE_MARCH", "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}", march):
        raise ConfigError(f"SPECSERVE_MARCH={march!r}: give a -march target such as native or x86-64-v3.")
    return march


def _build_dir() -> Path:
    from specserve.models.bundled import cache_dir

    key = hashlib.sha256()
    key.update(_SOURCE.read_bytes())
    key.update(torch.__version__.encode())
    # torch's headers are part of the build command: two environments each get their own build.
    key.update(str(Path(torch.__file__).resolve().parent).encode())
    key.update(_cpu_key().encode())
    if (march := _march()) != "native":
        key.update(march.encode())
    path = cache_dir() / "kernels" / key.hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    return path


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH. Put the pip-installed one first: it is not on PATH
    when the venv's python runs without activating the venv, and a system ninja of another
    version hashes build commands differently, so alternating between the two would recompile
    the kernels (a minute) every time."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep, 1)[0] != ninja.BIN_DIR:
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


@contextlib.contextmanager
def _build_lock(build: Path):
    """Hold an OS lock on the build directory while torch builds or loads into it.

    torch's builder marks a build in progress with a `lock` file and makes every other process
    wait until it is gone; a build killed midway (Ctrl-C during the first compile) leaves it
    behind and every later start would wait forever. The OS drops our lock when its holder
    dies, so whoever holds it is the only builder: a `lock` file found then is stale.
    """
    import fcntl

    with open(build / ".specserve-build.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            stale = build / "lock"
            if stale.exists():
                logger.warning("removing %s left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@functools.cache
def _load() -> ModuleType:
    from torch.utils import cpp_extension

    _ninja_on_path()
    build = _build_dir()
    fresh = not any(build.glob("*.so"))
    if fresh:
        logger.warning("compiling specserve's quantized-matmul kernel for this CPU (once, about a minute) into %s", build)
    flags = ["-O3", f"-march={_march()}", "-fopenmp"]
    from specserve.progress import spinner

    try:
        with _build_lock(build), \
                spinner("compiling specserve's native kernels for this CPU (once)") if fresh else contextlib.nullcontext():
            module = cpp_extension.load(
                name="specserve_qmatmul",
                sources=[str(_source_copy(build))],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                verbose=os.environ.get("SPECSERVE_VERBOSE_BUILD") == "1",
            )
    except Exception as exc:  # compiler missing, headers missing, ...
        raise KernelBuildError(
            f"could not build the quantized-matmul kernel ({type(exc).__name__}: {str(exc)[-400:]}). "
            "It needs a C++ compiler (g++) and ninja (pip install ninja); or run with --quantization none."
        ) from exc
    if fresh:  # a new source, torch or CPU: the builds of earlier versions may be long unused
        _prune_old_builds(build)
    _prefetch_from_env(module)
    global _loaded
    _loaded = module
    return module


KEEP_UNUSED_BUILDS_S = 30 * 86400  # a build directory no process has loaded for this long is removed


def _prune_old_builds(current: Path, now: float | None = None) -> list[Path]:
    """Remove the kernel builds beside `current` that no process has loaded for KEEP_UNUSED_BUILDS_S
    (each load rewrites its directory's lock file; each new version of the source, of torch or a
    new CPU gets a directory of its own, ~2.5 MB, which nothing else would ever delete). A build
    another process holds locked (building or loading) is left alone, and so is anything that is
    not a directory. Returns what was removed; never raises."""
    import fcntl

    now = time.time() if now is None else now
    removed = []
    with contextlib.suppress(OSError):
        for build in current.parent.iterdir():
            if build == current or not build.is_dir() or build.is_symlink():
                continue
            lock = build / ".specserve-build.lock"
            try:
                last_use = (lock if lock.exists() else build).stat().st_mtime
                if now - last_use < KEEP_UNUSED_BUILDS_S:
                    continue
                with open(lock, "a") as fh:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held elsewhere: OSError, skip it
                    shutil.rmtree(build)
                removed.append(build)
            except OSError:
                continue
    if removed:
        logger.info("removed %d kernel builds unused for %d days: %s", len(removed), KEEP_UNUSED_BUILDS_S // 86400,
                    ", ".join(p.name for p in removed))
    return removed


def _source_copy(build: Path) -> Path:
    """The kernel source inside its build directory, which ninja compiles from. The build
    command names the source's path, so compiling a checkout's own file made two checkouts with
    the same source (the directory's key) rebuild each other's kernels, a minute each time one
    ran after the other. Called under the build lock."""
    copy = build / _SOURCE.name
    source = _SOURCE.read_bytes()
    if not copy.is_file() or copy.read_bytes() != source:
        tmp = copy.with_suffix(".tmp")
        tmp.write_bytes(source)
        os.replace(tmp, copy)
    return copy


def _prefetch_pinned() -> str | None:
    """$SPECSERVE_PREFETCH when it pins a distance (unset, empty and 'auto' leave it to tune_prefetch)."""
    raw = os.environ.get("SPECSERVE_PREFETCH")
    return None if raw in (None, "", "auto") else raw


def _prefetch_from_env(module: ModuleType) -> None:
    raw = _prefetch_pinned()
    if raw is None:
        return
    try:
        parts = [int(v) for v in raw.split(",")]
        if len(parts) not in (1, 2) or not all(0 <= v <= 1 << 20 for v in parts):
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"SPECSERVE_PREFETCH={raw!r}: give the prefetch distance in bytes, 0 to 1048576 (0 turns it off), "
            "one for every pass or '<one-row>,<multi-row>', or 'auto' to let the first large model measure them."
        ) from None
    module.set_prefetch_distance(parts[0])
    module.set_prefetch_distance(parts[-1], multi_row=True)


# Distances tried by tune_prefetch, and the least weight bytes per step worth tuning on (below
# it the weights sit in cache and any distance looks the same).
PREFETCH_CANDIDATES = (1024, 2048, 3072, 4096, 6144, 8192)
PREFETCH_MULTI_CANDIDATES = (2048, 4096, 6144, 8192, 12288, 16384)
# The forwards the multi-row distance is timed on: few rows, where the weights still stream from
# DRAM and the distance decides the pass's speed (see tune_prefetch).
PREFETCH_MULTI_TOKENS = (2, 5)
PREFETCH_TUNE_MIN_BYTES = 64 << 20
_prefetch_tuned: dict[str, object] = {}
_TUNE_LOCK = threading.Lock()


T = TypeVar("T")


def _best_times(settings: Sequence[T], run: Callable[[T], float], rounds: int) -> dict[T, float]:
    """Best of `rounds` timings of each setting, the settings interleaved within each round (so
    drift over the rounds hits them all alike); run(setting) applies it and times one step."""
    best = dict.fromkeys(settings, math.inf)
    for _ in range(rounds):
        for setting in settings:
            best[setting] = min(best[setting], run(setting))
    return best


def tune_prefetch(time_step: Callable[[int], float], weight_bytes: int, rounds: int = 2) -> int | None:
    """Set the prefetch distances under which the model's forwards are fastest: the one-row
    distance from `time_step(1)`, the multi-row one from `time_step(n)` for each n in
    PREFETCH_MULTI_TOKENS (seconds of one forward of n tokens).

    The multi-row distance is timed where it matters: on a 2-vCPU Zen 4 (Qwen 1.5B, 4-minute
    sweeps) 2- and 3-token forwards at 4 KiB took 33.8 / 36.0 ms against 25.4 / 27.7 at 8 KiB
    (T(1) 25.2), 2 KiB twice that, while 8-token forwards were within 2% from 4 to 16 KiB. Timed on
    8 tokens alone (the rule before) the choice was noise, and a start that kept 4 KiB made every small
    verify pass ~25% slower; replayed over the sweeps, picking from 2 and 5 tokens cost at most 4%
    at any of 2 / 3 / 5 / 8 rows (the 8-token rule up to 20%, on the AVX2 build 42%).

    Runs once per process, on the first model with at least PREFETCH_TUNE_MIN_BYTES of weights
    per step: every candidate is timed `rounds` times, interleaved, and the best time of each
    decides (for several forwards, the least sum of each one's best time over its fastest
    candidate's). Prefetching changes speed only, never results, so a noisy pick costs nothing
    but a little speed. Returns the one-row distance chosen, or None when $SPECSERVE_PREFETCH pins
    them, the weights are too small to tell, or the distances were already chosen in this process.
    """
    if _prefetch_pinned() is not None or weight_bytes < PREFETCH_TUNE_MIN_BYTES:
        return None
    with _TUNE_LOCK:
        if _prefetch_tuned:
            return None
        module = kernels()
        if not module.has_avx2():  # the portable build does not prefetch
            return None
        one_row = _tune_distance(module, time_step, (1,), False, PREFETCH_CANDIDATES, rounds)
        multi_row = one_row and _tune_distance(module, time_step, PREFETCH_MULTI_TOKENS, True, PREFETCH_MULTI_CANDIDATES, rounds)
        if not multi_row:
            return None
        (one, one_ms), (multi, multi_ms) = one_row, multi_row
        _prefetch_tuned.update(distance=one, step_ms=one_ms, multi_row_distance=multi, multi_row_step_ms=multi_ms)
        logger.info("prefetch distance %d bytes, %d for multi-row passes (forward ms by distance, 1 token: %s; "
                    "%s tokens: %s)", one, multi, one_ms, " / ".join(map(str, PREFETCH_MULTI_TOKENS)), multi_ms)
        return one


def _tune_distance(module: ModuleType, time_step: Callable[[int], float], tokens: Sequence[int], multi_row: bool,
                   candidates: Sequence[int], rounds: int) -> tuple[int, dict[int, object]] | None:
    """Set the one-row or multi-row distance under which forwards of `tokens` (each count) are
    fastest together: the least sum over counts of each distance's best time over the fastest
    distance's. Returns it with the best milliseconds of each candidate (for several counts, a
    list in their order), or None (distance restored) when a forward cannot be timed here."""
    before = module.set_prefetch_distance(candidates[0], multi_row)
    if not all(math.isfinite(time_step(n)) for n in tokens):  # warm-up (first touch); NaN: cannot be timed here
        module.set_prefetch_distance(before, multi_row)
        return None

    def run(setting: tuple[int, int]) -> float:
        dist, n = setting
        module.set_prefetch_distance(dist, multi_row)
        return time_step(n)

    best = _best_times([(d, n) for d in candidates for n in tokens], run, rounds)
    fastest = {n: min(best[d, n] for d in candidates) for n in tokens}
    score = {d: sum(best[d, n] / fastest[n] for n in tokens) for d in candidates}
    choice = min(candidates, key=score.__getitem__)
    module.set_prefetch_distance(choice, multi_row)
    ms = {d: [round(best[d, n] * 1e3, 2) for n in tokens] for d in candidates}
    return choice, {d: v[0] if len(tokens) == 1 else v for d, v in ms.items()}


def prefetch_tuning() -> dict[str, object]:
    """What tune_prefetch measured and chose in this process (empty if it has not run)."""
    return dict(_prefetch_tuned)


# Pass widths (activation rows) at which tune_wide_passes compares the 512-bit and the 256-bit
# kernels, and the value that keeps every pass at 256 bits (more rows than a pass takes).
WIDE_CANDIDATES = (1, 2, 3, 4, 5, 6, 8)
WIDE_NEVER = 33
WIDE_MARGIN = 0.97  # the 512-bit pass must be at least 3% faster to be chosen
_wide_tuned: dict[str, object] = {}


def tune_wide_passes(time_step: Callable[[int], float], weight_bytes: int, rounds: int = 2,
                     time_hot: Callable[[int], float] | None = None) -> int | None:
    """Set from how many activation rows the AVX-512 passes run 512 bits wide, from forwards of
    the model at hand (`time_step(n)`: seconds of one forward of n tokens).

    Whether a 512-bit pass pays depends on the core and on how fast memory is at the moment: on
    a 2-vCPU Zen 5 (Qwen2.5-Coder-1.5B) it was 0.87-0.98x the 256-bit one at 1-3 rows, about even
    at 4 (whose 256-bit kernel keeps its sums in registers), 1.4-1.7x from 5 on; cores that split
    512-bit work in two halves gain less. For each candidate n the two are timed in
    interleaved rounds (best time each); the threshold is the smallest n from which the 512-bit
    pass wins at every larger candidate, or never.

    A forward that waits on memory hides which pass computes faster: on a 2-vCPU Zen 4 (Qwen
    1.5B) starts in a slow memory phase (one token 29-34 ms) timed the two even at 2-3 rows and
    chose 512 bits from 4, starts in a fast one (19-23 ms) chose it from 2; in the fast phase the
    256-bit passes then cost 8-16% more at 2-4 rows (products streamed 26.6 / 30.2 / 37.2 ms
    against 24.5 / 26.2 / 32.1), and a cached choice outlives the phase it was made in. So with
    `time_hot(n)` (seconds of products of n rows over weights already in cache: the arithmetic
    alone) the 512-bit pass also wins at n > 1 where it computes WIDE_MARGIN faster and its
    forward is no more than the same margin slower. Runs once per process, on the first model with
    at least PREFETCH_TUNE_MIN_BYTES of weights and only where the build has the AVX-512 path;
    results are bit-identical either way. Returns the threshold set, or None when nothing was tuned.
    """
    if weight_bytes < PREFETCH_TUNE_MIN_BYTES:
        return None
    with _TUNE_LOCK:
        if _wide_tuned:
            return None
        module = kernels()
        if not module.has_avx512():
            return None
        before = module.set_wide_min_rows(WIDE_NEVER)
        if not math.isfinite(time_step(WIDE_CANDIDATES[0])):
            module.set_wide_min_rows(before)
            return None

        def at_width(timer: Callable[[int], float]) -> Callable[[tuple[int, bool]], float]:
            def run(setting: tuple[int, bool]) -> float:
                n, wide = setting
                module.set_wide_min_rows(n if wide else WIDE_NEVER)
                return timer(n)
            return run

        settings = [(n, wide) for n in WIDE_CANDIDATES for wide in (False, True)]
        best = _best_times(settings, at_width(time_step), rounds)
        hot = None if time_hot is None else _best_times(settings, at_width(time_hot), rounds)

        def wins(n: int) -> bool:
            if best[n, True] <= WIDE_MARGIN * best[n, False]:
                return True
            # Not for one row: its pass is the read itself, and how it streams is what a cache
            # timing cannot see (the Zen 4's one-token forwards ran 512 bits wide at 0.83-1.00x
            # the 256-bit speed from start to start, while in cache it computed 1.15-1.22x faster).
            return (n > 1 and hot is not None and hot[n, True] <= WIDE_MARGIN * hot[n, False]
                    and WIDE_MARGIN * best[n, True] <= best[n, False])

        choice = WIDE_NEVER
        for n in reversed(WIDE_CANDIDATES):
            if not wins(n):
                break
            choice = n
        module.set_wide_min_rows(choice)
        _wide_tuned.update(min_rows=choice, ratio={n: round(best[n, False] / best[n, True], 3) for n in WIDE_CANDIDATES})
        if hot is not None:
            _wide_tuned["hot_ratio"] = {n: round(hot[n, False] / hot[n, True], 3) for n in WIDE_CANDIDATES}
        logger.info("512-bit passes from %d activation rows (256-bit / 512-bit time by rows: forwards %s, in cache %s)",
                    choice, _wide_tuned["ratio"], _wide_tuned.get("hot_ratio", "-"))
        return choice


def wide_tuning() -> dict[str, object]:
    """What tune_wide_passes measured and chose in this process (empty if it has not run)."""
    return dict(_wide_tuned)


def tune_or_restore(time_step: Callable[[int], float], weight_bytes: int, cache: StartupCache | None,
                    time_hot: Callable[[int], float] | None = None) -> bool:
    """tune_prefetch and tune_wide_passes, unless `cache` holds what an earlier start chose for
    this machine and model (then those choices are set, ~2.6 s sooner for the Qwen 1.5B on two
    Zen 4 vCPUs). A fresh choice is saved to the cache. Returns whether the cache served."""
    if weight_bytes < PREFETCH_TUNE_MIN_BYTES:
        return False
    with _TUNE_LOCK:
        if _prefetch_tuned or _wide_tuned:  # already chosen in this process
            return False
    saved = cache.load() if cache is not None else None
    if saved is not None and _restore_tuning(saved):
        logger.info("kernel tunings from %s: prefetch distance %s / %s bytes, 512-bit passes from %s rows",
                    cache.path, _prefetch_tuned.get("distance", "-"),  # type: ignore[union-attr]
                    _prefetch_tuned.get("multi_row_distance", "-"), _wide_tuned.get("min_rows", "-"))
        return True
    tune_prefetch(time_step, weight_bytes)
    tune_wide_passes(time_step, weight_bytes, time_hot=time_hot)
    if cache is not None and (_prefetch_tuned or _wide_tuned):
        cache.save({"prefetch": dict(_prefetch_tuned), "wide": dict(_wide_tuned)})
    return False


def _restore_tuning(saved: dict[str, object]) -> bool:
    """Set the distances and the wide-pass threshold `saved` holds (tune_or_restore); False, and
    nothing set, when they do not fit this build (a field missing or out of range)."""
    prefetch, wide = saved.get("prefetch"), saved.get("wide")
    if not isinstance(prefetch, dict) or not isinstance(wide, dict):
        return False
    module = kernels()
    want_prefetch = module.has_avx2() and _prefetch_pinned() is None
    want_wide = module.has_avx512()
    distances = (prefetch.get("distance"), prefetch.get("multi_row_distance"))
    rows = wide.get("min_rows")
    if want_prefetch and not all(isinstance(d, int) and 0 <= d <= 1 << 20 for d in distances):
        return False
    if want_wide and not (isinstance(rows, int) and 1 <= rows <= WIDE_NEVER):
        return False
    with _TUNE_LOCK:
        if want_prefetch:
            module.set_prefetch_distance(distances[0])
            module.set_prefetch_distance(distances[1], multi_row=True)
            _prefetch_tuned.update(prefetch, cached=True)
        if want_wide:
            module.set_wide_min_rows(rows)
            _wide_tuned.update(wide, cached=True)
    return True


def kernels() -> ModuleType:
    """The compiled kernel module (built on first call)."""
    with _LOCK:
        return _load()


def kernels_available() -> bool:
    """Whether the kernel builds and loads here (compiling it if needed)."""
    try:
        kernels()
        return True
    except KernelBuildError as exc:
        logger.warning("%s", exc)
        return False


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


@functools.cache
def _libc_madvise():  # noqa: ANN202 - a ctypes function pointer, or None
    """libc's madvise, looked up once (a CDLL lookup costs ~25 us, the prefaulter calls it per
    slice); None where there is none (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None


def madvise(addr: int, nbytes: int, advice: int) -> int:
    """madvise(2) over [addr, addr + nbytes) (addr page-aligned), the GIL released: 0, the errno
    it failed with, or -1 where the OS has no madvise (not Linux, no libc)."""
    fn = _libc_madvise()
    if fn is None:
        return -1
    import ctypes

    if fn(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), ctypes.c_int(advice)) == 0:
        return 0
    return ctypes.get_errno()


def _advise_huge_pages(addr: int, nbytes: int) -> None:
    """madvise(MADV_HUGEPAGE) over [addr, addr + nbytes) (both 2 MiB aligned), where the OS has it
    (advice only: small pages work too)."""
    madvise(addr, nbytes, _MADV_HUGEPAGE)


def pack_into_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (CPU, contiguous) laid out back to back in one buffer that the OS is
    asked to back with 2 MiB pages.

    Decode streams every weight once per step. On 4 KiB pages that is a TLB miss every 4 KiB
    and the prefetchers stop at each page edge; on a Xeon VM a 1.5B Q4_K_M step read its
    weights 10-18% faster from transparent huge pages (THP is often `madvise`-only, so
    torch's own allocations never get them). The advice is given before the first write, so
    the pages are huge from the start; where it is refused the copies still work.
    """
    align = 4096  # each tensor starts on its own page
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // align) * align
    if total == 0:
        return list(tensors)
    raw = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    _advise_huge_pages(raw.data_ptr() + start, -(-total // HUGE_PAGE) * HUGE_PAGE)
    out = []
    for t, off in zip(tensors, offsets):
        nbytes = t.numel() * t.element_size()
        view = raw[start + off : start + off + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out


def _rows_kernels(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> object | None:
    """The loaded kernels where `x` is what their per-row functions read (CPU [R, V] rows of one
    of `dtypes`, V >= 1, each row contiguous), else None: the caller asks torch. Never compiles."""
    module = _loaded
    if module is None or x.dim() != 2 or x.dtype not in dtypes or x.device.type != "cpu" or not x.shape[1] or x.stride(1) != 1:
        return None
    return module


def row_argmax(x: torch.Tensor) -> torch.Tensor:  # x: [R, V] -> int64 [R]
    """Each row's argmax, as torch.argmax(x, -1) (the first of equal values; NaN counts as the
    largest): natively for float32 CPU rows once this process has the kernels loaded (they are
    never compiled for it), else by torch. Greedy decoding and verification read it over every
    logits row of a step: a 152k-id row took torch 0.11 ms and takes the kernel ~0.02 (2-vCPU Xeon)."""
    module = _rows_kernels(x)
    if module is not None:
        return module.argmax_rows(x)  # type: ignore[attr-defined]
    return x.argmax(dim=-1)


TOPK_NATIVE_MAX = 64  # the native kernel's largest k


def row_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's k largest values in descending order, their indices, and the row's logsumexp
    (x: [R, V]; k <= V): the probability of a kept value is exp(value - logsumexp). Natively for
    float32 CPU rows once this process has the kernels loaded (of equal values the first one first),
    else, and for rows holding a NaN, +inf or fewer than k values above -inf, by torch (whose topk
    leaves the order of equal values unspecified). A drafter's tree reads it for every expanded
    node: torch's softmax and topk over a 152k-id row took ~0.47 ms, the kernel ~0.05 (2-vCPU Xeon)."""
    module = _rows_kernels(x)
    if module is not None and 1 <= k <= min(TOPK_NATIVE_MAX, x.shape[1]):
        values, indices, lse, ok = module.topk_rows(x, k)  # type: ignore[attr-defined]
        if ok:
            return values, indices, lse
    top = x.topk(k, dim=-1)
    return top.values, top.indices, x.logsumexp(dim=-1)


def native_truncation(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor, probs: bool = False) -> torch.Tensor | None:
    """Sampling's temperature, min-p, top-k and top-p of each row (x [R, V] float32; the settings [R])
    by the native kernel (`truncate_rows`: what sampler.process_logits defines, masses in float64;
    with `probs`, the softmax of the result), or None where it cannot answer (kernels not loaded in
    this process, not CPU float32 rows, a row holding a NaN, +inf or nothing above -inf): then the
    caller's torch path."""
    module = _rows_kernels(x)
    if module is None:
        return None
    out, ok = module.truncate_rows(x, temperature.float().contiguous(), top_k.long().contiguous(),  # type: ignore[attr-defined]
                                   top_p.float().contiguous(), min_p.float().contiguous(), probs)
    return out if ok else None


def native_sample(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, u: torch.Tensor, greedy_eps: float) -> torch.Tensor | None:
    """Per row, the token `native_inverse_cdf(native_truncation(x, ..., probs=True), u)` draws, bit for
    bit, in one native call without the [R, V] probabilities (`sample_rows`; temperatures below
    greedy_eps count as 1, as in sampler.process_logits); None where the kernels cannot answer (not
    loaded, not CPU float32 rows, a row holding a NaN, +inf or nothing above -inf): then the
    caller's two-step path."""
    module = _rows_kernels(x)
    if module is None or u.device.type != "cpu":
        return None
    out, ok = module.sample_rows(x, temperature.float().contiguous(), top_k.long().contiguous(),  # type: ignore[attr-defined]
                                 top_p.float().contiguous(), min_p.float().contiguous(), u.double().contiguous(), greedy_eps)
    return out if ok else None


def native_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """Per row, the first index whose float64 running sum reaches u times the row's sum, clamped
    (torch.searchsorted over probs.double().cumsum(-1): the same index, bit for bit), by the native
    kernel; None where it cannot answer (kernels not loaded, not CPU float32 / float64 rows, a row
    with a NaN, an infinity, a negative value or no mass)."""
    module = _rows_kernels(probs, (torch.float32, torch.float64))
    if module is None or u.device.type != "cpu":
        return None
    out, ok = module.inverse_cdf_rows(probs, u.double().contiguous())  # type: ignore[attr-defined]
    return out if ok else None


def qmatmul(x: torch.Tensor, w: torch.Tensor, qtype: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 @ W^T where W [N, row_bytes] holds GGUF blocks of `qtype`; + bias."""
    return kernels().qmatmul(x, w, qtype, bias)
