//! `baton demo` and its parts: vendor agents that know nothing of Baton,
//! and the run that puts Baton in front of them.

pub mod vendor;
