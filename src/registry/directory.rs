//! The live directory of agents the gateway routes to: each agent with its
//! published card, and the gateway's own card built from all of them.
//!
//! Reads are lock-free in practice (an `Arc` snapshot is cloned under a
//! short read lock). A change builds the next snapshot and the gateway card
//! under a writer mutex that readers never take, then swaps it in: changes
//! apply one after another, and no read waits on a rebuild. As a rebuild
//! costs as much as the card of every agent, start-up adds its stored agents
//! in one change ([`Directory::upsert_many`]) and registers its card files
//! under a [`Batch`], which rebuilds the gateway card once at its end.

use super::publish::{self, PublishedCard};
use crate::agents::{Agent, AgentHandle};
use crate::protocol::AgentCard;
use chrono::{DateTime, Utc};
use std::collections::BTreeMap;
#[cfg(test)]
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

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
    /// Limits and checks the agency set for the agent.
    pub policy: AgentPolicy,
    /// False once a health check failed, until one succeeds.
    healthy: AtomicBool,
}

impl AgentEntry {
    /// Whether the last health check (if any) succeeded.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
}

/// What an agency sets for its agent besides the card (DESIGN.md §3.4,
/// §4): limits that may only shorten the gateway's, who may hand off to
/// it, and the schemas its skills' results must satisfy.
#[derive(Clone, Debug, Default)]
pub struct AgentPolicy {
    /// The agent's task timeout.
    pub task_timeout: Option<std::time::Duration>,
    /// The agent's hop limit.
    pub max_hops: Option<u32>,
    /// How long the agent may take to acknowledge.
    pub ack_timeout: Option<std::time::Duration>,
    /// The agents allowed to hand off to it; `None` allows every agent.
    pub allow_from: Option<Vec<String>>,
    /// JSON Schemas of its skills' results, by skill id.
    pub skill_output_schemas: Option<Arc<serde_json::Map<String, serde_json::Value>>>,
}

impl AgentPolicy {
    /// Whether `source` may hand off to the agent.
    pub fn allows(&self, source: &str) -> bool {
        self.allow_from
            .as_ref()
            .is_none_or(|allowed| allowed.iter().any(|id| id == source))
    }
}

/// An agent to add with [`Directory::upsert_many`].
pub struct NewAgent {
    /// The agent id.
    pub id: String,
    /// The principal that registered it.
    pub owner: String,
    /// The implementation.
    pub agent: Arc<dyn Agent>,
    /// Limits and checks the agency set for it.
    pub policy: AgentPolicy,
    /// Its card's Last-Modified.
    pub modified: DateTime<Utc>,
}

struct Snapshot {
    agents: BTreeMap<String, Arc<AgentEntry>>,
    gateway_card: Arc<PublishedCard>,
}

/// Every agent the gateway can route to.
pub struct Directory {
    public_url: String,
    push_enabled: bool,
    /// Published cards declare Baton's API-key scheme (some key exists).
    secured: AtomicBool,
    /// Held by a change from reading the snapshot to swapping in the next,
    /// so that concurrent changes do not lose each other. std Mutex: a
    /// change never awaits.
    writer: Mutex<Writer>,
    // std RwLock: held only to clone or swap an Arc.
    snapshot: RwLock<Arc<Snapshot>>,
    /// How many times the gateway card was built.
    #[cfg(test)]
    gateway_cards_built: AtomicUsize,
}

/// What changes share besides the snapshot.
#[derive(Default)]
struct Writer {
    /// Open [`Batch`]es: while there is one, changes keep the gateway card.
    batches: usize,
    /// The gateway card was kept over a change, to be rebuilt when the last
    /// batch ends.
    stale: bool,
}

/// Changes made while it lives keep the gateway card as it was; it is
/// rebuilt once, when the last open batch ends. For start-up, when many
/// agents are added before anyone reads the card.
pub struct Batch<'a> {
    directory: &'a Directory,
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        let directory = self.directory;
        // No panic here, which may run while unwinding: a panicked change
        // left the snapshot whole, as it only swaps Arcs.
        let mut writer = directory
            .writer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        writer.batches -= 1;
        if writer.batches == 0 && std::mem::take(&mut writer.stale) {
            directory.change_under(&mut writer, |_| {});
        }
    }
}

impl Directory {
    /// An empty directory publishing under `public_url`.
    pub fn new(public_url: &str, push_enabled: bool) -> Self {
        let public_url = public_url.trim_end_matches('/').to_string();
        let gateway_card = PublishedCard::new(
            publish::gateway_card(&[], &public_url, push_enabled, false),
            Utc::now(),
        );
        Self {
            public_url,
            push_enabled,
            secured: AtomicBool::new(false),
            writer: Mutex::default(),
            snapshot: RwLock::new(Arc::new(Snapshot {
                agents: BTreeMap::new(),
                gateway_card: Arc::new(gateway_card),
            })),
            #[cfg(test)]
            gateway_cards_built: AtomicUsize::new(0),
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
        let agents = agents.into_iter().map(|handle| NewAgent {
            id: handle.id,
            owner: owner.to_string(),
            agent: handle.agent,
            policy: AgentPolicy::default(),
            modified: Utc::now(),
        });
        directory.upsert_many(agents.collect());
        directory
    }

    /// Whether API keys are required (see [`Self::set_secured`]).
    pub fn is_secured(&self) -> bool {
        self.secured.load(Ordering::Relaxed)
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

    /// `card` as it is published for agent `id` now; `has_extended` says
    /// whether Baton holds the agent's extended card.
    pub fn publish(&self, id: &str, card: &AgentCard, has_extended: bool) -> AgentCard {
        let secured = self.secured.load(Ordering::Relaxed);
        let push = self.push_enabled;
        publish::publish_agent_card(card, id, &self.public_url, push, secured, has_extended)
    }

    /// Adds or replaces an agent; `modified` is its card's Last-Modified.
    pub fn upsert(
        &self,
        id: &str,
        owner: &str,
        agent: Arc<dyn Agent>,
        policy: AgentPolicy,
        modified: DateTime<Utc>,
    ) -> Arc<AgentEntry> {
        let agent = NewAgent {
            id: id.to_string(),
            owner: owner.to_string(),
            agent,
            policy,
            modified,
        };
        let mut inserted = self.upsert_many(vec![agent]);
        inserted.pop().expect("inserted under the lock")
    }

    /// Adds or replaces `agents` in one change, rebuilding the gateway card
    /// once; their entries, in order.
    pub fn upsert_many(&self, agents: Vec<NewAgent>) -> Vec<Arc<AgentEntry>> {
        let mut inserted = Vec::with_capacity(agents.len());
        // Published under the writer lock, so that a change of `secured`
        // cannot slip between the cards' publication and their insertion.
        self.change(|entries| {
            for new in agents {
                let NewAgent {
                    id,
                    owner,
                    agent,
                    policy,
                    modified,
                } = new;
                let entry = Arc::new(self.entry(&id, &owner, agent, policy, modified, true));
                entries.insert(id, entry.clone());
                inserted.push(entry);
            }
        });
        inserted
    }

    /// Opens a [`Batch`].
    #[must_use = "the batch ends when it is dropped"]
    pub fn batch(&self) -> Batch<'_> {
        self.writer.lock().expect("directory writer lock").batches += 1;
        Batch { directory: self }
    }

    /// How many times the gateway card was built.
    #[cfg(test)]
    pub(crate) fn gateway_cards_built(&self) -> usize {
        self.gateway_cards_built.load(Ordering::Relaxed)
    }

    /// An agent's entry, its cards published as Baton serves them now.
    fn entry(
        &self,
        id: &str,
        owner: &str,
        agent: Arc<dyn Agent>,
        policy: AgentPolicy,
        modified: DateTime<Utc>,
        healthy: bool,
    ) -> AgentEntry {
        let extended = agent
            .extended_card()
            .map(|extended| self.publish(id, &extended, true));
        let card = self.publish(id, agent.card(), extended.is_some());
        AgentEntry {
            id: id.to_string(),
            owner: owner.to_string(),
            agent,
            card: PublishedCard::new(card, modified),
            extended,
            policy,
            healthy: AtomicBool::new(healthy),
        }
    }

    /// Records the outcome of an agent's health check.
    pub fn set_healthy(&self, id: &str, healthy: bool) {
        if let Some(entry) = self.get(id) {
            entry.healthy.store(healthy, Ordering::Relaxed);
        }
    }

    /// Says whether API keys are required, re-publishing every card when
    /// that changes (the cards then declare, or stop declaring, the scheme).
    /// The entries are rebuilt under the writer lock from the directory as
    /// it is then: an agent removed or replaced meanwhile stays so.
    pub fn set_secured(&self, secured: bool) {
        if self.secured.swap(secured, Ordering::Relaxed) == secured {
            return;
        }
        let now = Utc::now();
        self.change(|agents| {
            for entry in agents.values_mut() {
                let republished = self.entry(
                    &entry.id,
                    &entry.owner,
                    entry.agent.clone(),
                    entry.policy.clone(),
                    now,
                    entry.is_healthy(),
                );
                *entry = Arc::new(republished);
            }
        });
    }

    /// Removes an agent; false when there was none.
    pub fn remove(&self, id: &str) -> bool {
        let mut removed = false;
        self.change(|agents| removed = agents.remove(id).is_some());
        removed
    }

    /// Applies `edit` to a copy of the agents and swaps in the result with
    /// its gateway card; only the swap takes the lock readers take.
    fn change(&self, edit: impl FnOnce(&mut BTreeMap<String, Arc<AgentEntry>>)) {
        let mut writer = self.writer.lock().expect("directory writer lock");
        self.change_under(&mut writer, edit);
    }

    /// [`Self::change`], its writer lock held: outside a batch the gateway
    /// card is built again, inside one it is kept and noted stale.
    fn change_under(
        &self,
        writer: &mut Writer,
        edit: impl FnOnce(&mut BTreeMap<String, Arc<AgentEntry>>),
    ) {
        let current = self.current();
        let mut agents = current.agents.clone();
        edit(&mut agents);
        let gateway_card = if writer.batches > 0 {
            writer.stale = true;
            current.gateway_card.clone()
        } else {
            self.build_gateway_card(&agents, &current.gateway_card)
        };
        let next = Arc::new(Snapshot {
            agents,
            gateway_card,
        });
        *self.snapshot.write().expect("directory lock") = next;
    }

    /// The gateway card of `agents`; `previous` when it is the same card.
    fn build_gateway_card(
        &self,
        agents: &BTreeMap<String, Arc<AgentEntry>>,
        previous: &Arc<PublishedCard>,
    ) -> Arc<PublishedCard> {
        #[cfg(test)]
        self.gateway_cards_built.fetch_add(1, Ordering::Relaxed);
        let cards: Vec<(&str, &AgentCard)> = agents
            .values()
            .map(|entry| (entry.id.as_str(), entry.agent.card()))
            .collect();
        let secured = self.secured.load(Ordering::Relaxed);
        let card = publish::gateway_card(&cards, &self.public_url, self.push_enabled, secured);
        // The ETag changes only when the card does, whatever the time.
        if card == previous.card {
            previous.clone()
        } else {
            Arc::new(PublishedCard::new(card, Utc::now()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agents::{AgentError, AgentEvents, AgentRequest};
    use std::sync::Barrier;
    use std::time::Duration;

    /// An agent with one skill, `work`, whose card, once `armed`, is handed
    /// out only when the test lets it: a rebuild of the gateway card stops
    /// there.
    struct HeldCard {
        card: AgentCard,
        armed: AtomicBool,
        entered: Barrier,
        released: Barrier,
    }

    impl HeldCard {
        fn new() -> Arc<Self> {
            let mut card = crate::agents::echo::EchoAgent::new().card().clone();
            card.skills.truncate(1);
            card.skills[0].id = "work".into();
            Arc::new(Self {
                card,
                armed: AtomicBool::new(false),
                entered: Barrier::new(2),
                released: Barrier::new(2),
            })
        }
    }

    #[async_trait::async_trait]
    impl Agent for HeldCard {
        fn card(&self) -> &AgentCard {
            if self.armed.swap(false, Ordering::SeqCst) {
                self.entered.wait();
                self.released.wait();
            }
            &self.card
        }

        async fn execute(&self, _: AgentRequest, _: AgentEvents) -> Result<(), AgentError> {
            Ok(())
        }
    }

    fn add(directory: &Directory, id: &str, agent: Arc<HeldCard>) {
        directory.upsert(id, "acme", agent, AgentPolicy::default(), Utc::now());
    }

    /// A read does not wait while a change rebuilds the gateway card.
    #[test]
    fn reads_do_not_wait_on_a_rebuild() {
        let directory = Arc::new(Directory::new("http://localhost:8080", true));
        let held = HeldCard::new();
        add(&directory, "held", held.clone());
        held.armed.store(true, Ordering::SeqCst);
        let writer = std::thread::spawn({
            let directory = directory.clone();
            move || add(&directory, "other", HeldCard::new())
        });
        // The change is building the gateway card, at the held agent's card.
        held.entered.wait();
        let (read, was_read) = std::sync::mpsc::channel();
        let reader = std::thread::spawn({
            let directory = directory.clone();
            move || read.send(directory.get("held").is_some()).unwrap()
        });
        let found = was_read.recv_timeout(Duration::from_secs(2));
        held.released.wait();
        writer.join().unwrap();
        reader.join().unwrap();
        assert_eq!(found, Ok(true), "the read waited on the rebuild");
        let skills = directory.gateway_card().card.skills.len();
        assert_eq!(skills, 2, "both agents' skills are in the gateway card");
    }

    /// Changes made at once all land: none is built from a snapshot another
    /// replaced meanwhile.
    #[test]
    fn concurrent_changes_all_reach_the_gateway_card() {
        let directory = Arc::new(Directory::new("http://localhost:8080", true));
        let threads: Vec<_> = (0..8)
            .map(|thread| {
                let directory = directory.clone();
                std::thread::spawn(move || {
                    for n in 0..25 {
                        add(&directory, &format!("agent-{thread}-{n}"), HeldCard::new());
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(directory.list().len(), 200);
        let card = directory.gateway_card();
        let mut skills: Vec<&str> = card.card.skills.iter().map(|s| s.id.as_str()).collect();
        skills.sort();
        let mut expected: Vec<String> = (0..8)
            .flat_map(|thread| (0..25).map(move |n| format!("agent-{thread}-{n}/work")))
            .collect();
        expected.sort();
        assert_eq!(skills, expected);
    }
}
