//! The Debian kernels of the kernel matrix, pinned: `./dev setup` downloads and unpacks them
//! (xtask includes this file), the virtual machines of the tests boot them.

/// One pinned Debian kernel package.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel {
    /// Its short name, as the tests and the `guest` command call it: `5.10`, `6.1`, `6.12`.
    pub name: &'static str,
    /// The Debian release whose main archive holds it.
    pub suite: &'static str,
    /// Its release, as `uname -r` prints it; the package is `linux-image-<release>`.
    pub release: &'static str,
    /// The package's exact version.
    pub version: &'static str,
}

impl Kernel {
    /// The binary package's name.
    pub fn package(&self) -> String {
        format!("linux-image-{}", self.release)
    }
}

/// The kernels of the matrix, oldest first.
pub const KERNELS: [Kernel; 3] = [
    Kernel {
        name: "5.10",
        suite: "bullseye",
        release: "5.10.0-32-amd64",
        version: "5.10.223-1",
    },
    Kernel {
        name: "6.1",
        suite: "bookworm",
        release: "6.1.0-50-amd64",
        version: "6.1.176-1",
    },
    Kernel {
        name: "6.12",
        suite: "trixie",
        release: "6.12.117+deb13-amd64",
        version: "6.12.117-1",
    },
];
