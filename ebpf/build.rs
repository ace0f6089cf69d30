//! Rebuild the eBPF programs when `bpf-linker` changes: cargo cannot see that dependency, and
//! an object linked by a stale linker is the most confusing failure this project can have.

fn main() {
    // Debian's 6.1 refuses a loop that a fall-through edge closes ("back-edge from insn N to
    // N+1"; 6.12 accepts it); LLVM's block placement lays loops out that way (the latch above
    // the header). Without it, every loop closes with a jump.
    println!("cargo::rustc-link-arg-bins=--llvm-args=-disable-block-placement");
    match which::which("bpf-linker") {
        Ok(path) => println!("cargo:rerun-if-changed={}", path.display()),
        Err(err) => {
            println!("cargo:warning=bpf-linker not found on PATH ({err}); run `./dev setup`")
        }
    }
}
