//! What the policy's tests share with the tests of the crates that answer with it.

pub mod strategies;
