//! Rebuild the eBPF programs when `bpf-linker` changes: cargo cannot see that dependency, and
//! an object linked by a stale linker is the most confusing failure this project can have.

fn main() {
    match which::which("bpf-linker") {
        Ok(path) => println!("cargo:rerun-if-changed={}", path.display()),
        Err(err) => {
            println!("cargo:warning=bpf-linker not found on PATH ({err}); run `./dev setup`")
        }
    }
}
