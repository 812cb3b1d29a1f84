//! Handoffs across vendors (`urn:baton:handoff:v1`, DESIGN.md §3): the
//! control metadata every call carries, the typed handoff payload, the
//! policy checks before forwarding, and the routing rules.

pub mod artifacts;
pub mod context;
pub mod control;
pub mod payload;
pub mod reasons;
pub mod routing;
