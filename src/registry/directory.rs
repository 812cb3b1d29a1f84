//! The live directory of agents the gateway routes to: each agent with its
//! published card, and the gateway's own card built from all of them.
//!
//! Reads are lock-free in practice (an `Arc` snapshot is cloned under a
//! short read lock); a change rebuilds the snapshot and the gateway card.

use super::publish::{self, PublishedCard};
use crate::agents::{Agent, AgentHandle};
use crate::protocol::AgentCard;
use chrono::{DateTime, Utc};
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

/// One routable agent.
pub struct AgentEntry {
    /// The agent id (path segment and tenant).
    pub id: String,
    /// The principal that registered it.
    pub owner: String,
    /// The implementation: built-in or remote.
    pub agent: Arc<dyn Agent>,
    /// The card as Baton publishes it.
    pub card: PublishedCard,
    /// The published extended card, when the agent has one.
    pub extended: Option<AgentCard>,
}

struct Snapshot {
    agents: BTreeMap<String, Arc<AgentEntry>>,
    gateway_card: Arc<PublishedCard>,
}

/// Every agent the gateway can route to.
pub struct Directory {
    public_url: String,
    push_enabled: bool,
    // std RwLock: held only to clone or swap an Arc.
    snapshot: RwLock<Arc<Snapshot>>,
}

impl Directory {
    /// An empty directory publishing under `public_url`.
    pub fn new(public_url: &str, push_enabled: bool) -> Self {
        let public_url = public_url.trim_end_matches('/').to_string();
        let gateway_card = PublishedCard::new(
            publish::gateway_card(&[], &public_url, push_enabled),
            Utc::now(),
        );
        Self {
            public_url,
            push_enabled,
            snapshot: RwLock::new(Arc::new(Snapshot {
                agents: BTreeMap::new(),
                gateway_card: Arc::new(gateway_card),
            })),
        }
    }

    /// A directory of `agents`, all owned by `owner`.
    pub fn with_agents(
        public_url: &str,
        push_enabled: bool,
        owner: &str,
        agents: Vec<AgentHandle>,
    ) -> Self {
        let directory = Self::new(public_url, push_enabled);
        for handle in agents {
            directory.upsert(&handle.id, owner, handle.agent, Utc::now());
        }
        directory
    }

    /// The base URL cards point at.
    pub fn public_url(&self) -> &str {
        &self.public_url
    }

    fn current(&self) -> Arc<Snapshot> {
        self.snapshot.read().expect("directory lock").clone()
    }

    /// An agent by id.
    pub fn get(&self, id: &str) -> Option<Arc<AgentEntry>> {
        self.current().agents.get(id).cloned()
    }

    /// Every agent, by id.
    pub fn list(&self) -> Vec<Arc<AgentEntry>> {
        self.current().agents.values().cloned().collect()
    }

    /// The gateway's own card.
    pub fn gateway_card(&self) -> Arc<PublishedCard> {
        self.current().gateway_card.clone()
    }

    /// Adds or replaces an agent; `modified` is its card's Last-Modified.
    pub fn upsert(
        &self,
        id: &str,
        owner: &str,
        agent: Arc<dyn Agent>,
        modified: DateTime<Utc>,
    ) -> Arc<AgentEntry> {
        let card =
            publish::publish_agent_card(agent.card(), id, &self.public_url, self.push_enabled);
        let extended = agent.extended_card().map(|extended| {
            publish::publish_agent_card(&extended, id, &self.public_url, self.push_enabled)
        });
        let entry = Arc::new(AgentEntry {
            id: id.to_string(),
            owner: owner.to_string(),
            agent,
            card: PublishedCard::new(card, modified),
            extended,
        });
        self.change(|agents| {
            agents.insert(id.to_string(), entry.clone());
        });
        entry
    }

    /// Removes an agent; false when there was none.
    pub fn remove(&self, id: &str) -> bool {
        let mut removed = false;
        self.change(|agents| removed = agents.remove(id).is_some());
        removed
    }

    fn change(&self, edit: impl FnOnce(&mut BTreeMap<String, Arc<AgentEntry>>)) {
        let mut guard = self.snapshot.write().expect("directory lock");
        let mut agents = guard.agents.clone();
        edit(&mut agents);
        let cards: Vec<(&str, &AgentCard)> = agents
            .values()
            .map(|entry| (entry.id.as_str(), entry.agent.card()))
            .collect();
        let card = publish::gateway_card(&cards, &self.public_url, self.push_enabled);
        // The ETag changes only when the card does, whatever the time.
        let gateway_card = if card == guard.gateway_card.card {
            guard.gateway_card.clone()
        } else {
            Arc::new(PublishedCard::new(card, Utc::now()))
        };
        *guard = Arc::new(Snapshot {
            agents,
            gateway_card,
        });
    }
}
