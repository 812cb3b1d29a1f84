//! The agent registry: the live directory of routable agents and the
//! publication of their cards.

pub mod directory;
pub mod publish;

pub use directory::{AgentEntry, Directory};
