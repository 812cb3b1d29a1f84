//! The agent registry: agencies register their agents' cards; Baton
//! validates, stores and publishes them, and routes to what is registered.

pub mod directory;
pub mod fetch;
pub mod publish;
pub mod record;
pub mod rpc;
pub mod schema;
pub mod service;

pub use directory::{AgentEntry, Directory};
pub use service::Registry;
