//! Counter vocabularies: a `#[repr(u32)]` enum whose entries index a BPF array or a field,
//! with every entry and its name defined in one place.

/// Declares a `#[repr(u32)]` enum numbered 0, 1, 2, … in the order written, with `ALL` (every
/// entry, in that order, so `ALL[i] as usize == i`) and `as_str` (the entry's name in metrics,
/// logs and docs/metrics.md).
macro_rules! vocabulary {
    ($(#[$meta:meta])* pub enum $name:ident {
        $($(#[$vmeta:meta])* $variant:ident => $text:literal,)+
    }) => {
        $(#[$meta])*
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every entry, in index order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            /// The entry's name: its label value or metric name, as docs/metrics.md writes it.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }
        }
    };
}
