//! Vocabularies: a fieldless `#[repr(u32)]` enum with every entry and its name defined in one
//! place. The counters of the kernel programs are vocabularies (their entries index a BPF array
//! or a field); the policy crate's `names!` builds its printed and parsed vocabularies on this.

/// Declares a `#[repr(u32)]` enum numbered 0, 1, 2, … in the order written, with `ALL` (every
/// entry, in that order, so `ALL[i] as usize == i`) and `as_str` (the entry's name on the wire,
/// in metrics, logs and docs/metrics.md).
#[macro_export]
macro_rules! vocabulary {
    ($(#[$meta:meta])* pub enum $name:ident {
        $($(#[$vmeta:meta])* $variant:ident => $text:literal,)+
    }) => {
        $(#[$meta])*
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every entry, in index order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            /// The entry's name: on the wire, in metrics and logs, as the docs write it.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }
        }
    };
}
