#!/usr/bin/env python3
"""Build small stub .so files for the CUDA libraries that PyPI's (CUDA) torch wheel
links against, so `import torch` works on a CPU-only machine without the 2 GB of
nvidia-* wheels (./dev setup runs it in .tools/vllm-venv).  Every stub function fails (returns a non-zero code; the
"get error string" family returns ""; cudaGetDeviceCount reports no device), so
torch.cuda.is_available() is False and nothing CUDA can run.

Needs: readelf (binutils) and gcc.  Reads only the installed torch binaries.
usage: cuda_stubs.py SITE_PACKAGES [OUT_DIR]
OUT_DIR defaults to SITE_PACKAGES/nvidia/cu13/lib, which is on torch's RPATH
($ORIGIN/../../nvidia/cu13/lib).
"""
import glob, os, re, subprocess, sys, tempfile

sp = os.path.abspath(sys.argv[1])
out = os.path.abspath(sys.argv[2]) if len(sys.argv) > 2 else os.path.join(sp, "nvidia", "cu13", "lib")
CUDA_RE = re.compile(r"^lib(cudart|cublas|cublasLt|cudnn|cufft|curand|cusparse|cusparseLt|cusolver|nccl|nvrtc|"
                     r"nvshmem_host|cupti|cufile|nvJitLink|nvToolsExt)\.so(\.\d+)*$")
# What gets dlopen'ed in a CPU-only vLLM process: torch's own libs and torchvision's op library.
binaries = sorted(glob.glob(os.path.join(sp, "torch", "lib", "*.so*")) + glob.glob(os.path.join(sp, "torchvision", "_C.so")))


def run(*a):
    return subprocess.run(a, check=True, capture_output=True, text=True).stdout


def needed(path):
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", run("readelf", "-d", "-W", path))


def verneed(path):
    """version name -> file, from .gnu.version_r"""
    m, cur = {}, None
    for l in run("readelf", "-V", "-W", path).splitlines():
        f = re.search(r"Version: \d+\s+File: (\S+)", l)
        if f:
            cur = f.group(1); continue
        n = re.search(r"Name: (\S+)\s+Flags", l)
        if n and cur:
            m[n.group(1)] = cur
    return m


def dynsyms(path):
    """yield (name, version or None, type, bind, ndx)"""
    for l in run("readelf", "--dyn-syms", "-W", path).splitlines():
        p = l.split()
        if len(p) < 8 or not p[0].endswith(":") or not p[0][:-1].isdigit():
            continue
        name = p[7]
        ver = None
        if "@" in name:
            name, _, ver = name.partition("@")
            ver = ver.lstrip("@")
            if len(p) > 8 and ver == "":
                ver = None
        yield name, ver, p[3], p[4], p[6]


system_libs = ["libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "libdl.so.2", "libpthread.so.0",
               "librt.so.1", "ld-linux-x86-64.so.2"]
ldcache = {}
for l in run("ldconfig", "-p").splitlines():
    m = re.match(r"\s+(\S+) \(libc6,x86-64[^)]*\) => (\S+)", l)
    if m:
        ldcache.setdefault(m.group(1), m.group(2))

import sysconfig
pyobjs = [os.path.realpath(sys.executable)]
libpy = os.path.join(sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("LDLIBRARY") or "")
if os.path.isfile(libpy) and libpy.endswith(".so") or ".so." in libpy:
    pyobjs.append(libpy)
defined = set()
for b in binaries + [ldcache[s] for s in system_libs if s in ldcache] + pyobjs:
    for name, ver, typ, bind, ndx in dynsyms(b):
        if ndx != "UND":
            defined.add(name)

stubs = {}          # soname -> {symbol: (version or None, type)}
unversioned = {}    # symbol -> type, to be placed in every stub
for b in binaries:
    miss = [n for n in needed(b) if CUDA_RE.match(n)]
    if not miss:
        continue
    vn = verneed(b)
    for so in miss:
        stubs.setdefault(so, {})
    for name, ver, typ, bind, ndx in dynsyms(b):
        if ndx != "UND" or bind == "WEAK":
            continue
        if ver and vn.get(ver) in stubs:
            stubs[vn[ver]][name] = (ver, typ)
        elif not ver and name not in defined and not name.startswith(("Py", "_Py")):
            unversioned[name] = typ

os.makedirs(out, exist_ok=True)
ERR_STRING = re.compile(r"(GetErrorString|GetErrorName|GetStatusString|GetStatusName|GetString)$")
with tempfile.TemporaryDirectory() as tmp:
    for so, syms in sorted(stubs.items()):
        allsyms = dict(syms)
        for n, t in unversioned.items():
            allsyms.setdefault(n, (None, t))
        vers = sorted({v for v, _ in allsyms.values() if v}) or [so]
        c = ["#include <stdint.h>", "static char stub_zero[4096] __attribute__((aligned(64)));",
             "static const char stub_empty[] = \"\";"]
        for n, (v, t) in sorted(allsyms.items()):
            if t == "OBJECT":
                c.append(f"char {n}[4096];")
            elif n == "cudaGetDeviceCount":
                c.append(f"int {n}(int *c) {{ if (c) *c = 0; return 100; /* cudaErrorNoDevice */ }}")
            elif ERR_STRING.search(n):
                c.append(f"const char *{n}(void) {{ return stub_empty; }}")
            else:
                # int-returning APIs get a non-zero (failure) code; pointer-returning ones a zeroed buffer
                c.append(f"intptr_t {n}(void) {{ return (intptr_t)stub_zero; }}")
        src = os.path.join(tmp, so + ".c"); vs = os.path.join(tmp, so + ".map")
        open(src, "w").write("\n".join(c) + "\n")
        # all symbols in the (single) version node named like the real library's
        open(vs, "w").write(f"{vers[0]} {{\n  global:\n" + "".join(f"    {n};\n" for n in sorted(allsyms)) + "  local: *;\n};\n")
        run("gcc", "-shared", "-fPIC", "-O0", "-w", "-o", os.path.join(out, so), f"-Wl,-soname,{so}",
            f"-Wl,--version-script={vs}", src)
        print(f"{so}: {len(syms)} versioned + {len(unversioned)} unversioned symbols, version {vers}")
print("stubs written to", out)
