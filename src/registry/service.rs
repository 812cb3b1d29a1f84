//! The registry methods (DESIGN.md §4): agencies register, update and remove
//! their agents' cards; anyone with a key reads and searches them. Records
//! live in the ledger; the directory routes to what is registered.

use super::directory::{AgentPolicy, Directory, NewAgent};
use super::fetch::{CardFetcher, FetchError};
use super::publish::PublishedCard;
use super::record::{AgentRecord, Health, HealthStatus};
use super::schema::CardValidator;
use crate::agents::{Agent, AgentHandle};
use crate::error::{FieldViolation, GatewayError};
use crate::gateway::validate::media_type_matches;
use crate::handoff::routing::{AgentView, declared_skill};
use crate::protocol::AgentCard;
use crate::schema_support::escape;
use crate::store::Ledger;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::Utc;
use serde::Deserialize;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, RwLock};

/// Builds the agent that serves a registered card (a remote A2A agent).
pub type AgentFactory =
    Arc<dyn Fn(&str, &AgentCard) -> Result<Arc<dyn Agent>, String> + Send + Sync>;

/// Params of `RegisterAgent` and `UpdateAgent`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RegisterParams {
    /// The agent id (derived from the card's name when absent on register).
    #[serde(default)]
    pub id: Option<String>,
    /// The card, inline.
    #[serde(default)]
    pub card: Option<Value>,
    /// Where to fetch the card.
    #[serde(default, alias = "card_url")]
    pub card_url: Option<String>,
    /// JSON Schemas of skill outputs, by skill id.
    #[serde(default, alias = "skill_output_schemas")]
    pub skill_output_schemas: Option<Map<String, Value>>,
    /// The agent's task timeout in milliseconds.
    #[serde(default, alias = "task_timeout_ms")]
    pub task_timeout_ms: Option<u64>,
    /// The agent's hop limit (it may only shorten the gateway's).
    #[serde(default, alias = "max_hops")]
    pub max_hops: Option<u32>,
    /// How long the agent may take to acknowledge, in milliseconds.
    #[serde(default, alias = "ack_timeout_ms")]
    pub ack_timeout_ms: Option<u64>,
    /// The agents allowed to hand off to it (absent: every agent).
    #[serde(default, alias = "allow_from")]
    pub allow_from: Option<Vec<String>>,
}

impl RegisterParams {
    /// Refuses limits that cannot hold: zero timeouts, a zero hop limit,
    /// empty agent ids in the allow list; and an allow list past its bounds.
    fn check_limits(&self) -> Result<(), GatewayError> {
        if self.task_timeout_ms == Some(0) {
            return Err(GatewayError::invalid_field(
                "taskTimeoutMs",
                "must be at least 1",
            ));
        }
        if self.ack_timeout_ms == Some(0) {
            return Err(GatewayError::invalid_field(
                "ackTimeoutMs",
                "must be at least 1",
            ));
        }
        if self.max_hops == Some(0) {
            return Err(GatewayError::invalid_field("maxHops", "must be at least 1"));
        }
        if let Some(index) = self
            .allow_from
            .iter()
            .flatten()
            .position(|id| id.trim().is_empty())
        {
            return Err(GatewayError::invalid_field(
                format!("allowFrom[{index}]"),
                "must be a non-empty agent id",
            ));
        }
        let allowed = self.allow_from.as_deref().unwrap_or_default();
        if allowed.len() > MAX_ALLOW_FROM {
            return Err(GatewayError::invalid_field(
                "allowFrom",
                format!(
                    "has {} agent ids, more than the {MAX_ALLOW_FROM} it may have",
                    allowed.len()
                ),
            ));
        }
        if let Some(index) = allowed
            .iter()
            .position(|id| id.len() > MAX_ALLOW_FROM_ID_BYTES)
        {
            return Err(GatewayError::invalid_field(
                format!("allowFrom[{index}]"),
                format!("is longer than the {MAX_ALLOW_FROM_ID_BYTES} bytes an agent id may be"),
            ));
        }
        Ok(())
    }
}

impl RegisterParams {
    /// Refuses the `skillOutputSchemas` given that could never check a
    /// result: one that does not compile (each task of its skill would fail
    /// only once its work is done) or one keyed by no skill of `card` (it
    /// would never apply), and schemas past their size bounds. Keys match
    /// skills as the relay looks them up.
    fn check_output_schemas(&self, id: &str, card: &AgentCard) -> Result<(), GatewayError> {
        let Some(schemas) = &self.skill_output_schemas else {
            return Ok(());
        };
        let view = AgentView {
            id,
            card,
            healthy: true,
        };
        let sizes: Vec<usize> = schemas
            .values()
            .map(|schema| serde_json::to_vec(schema).map_or(0, |encoded| encoded.len()))
            .collect();
        let total: usize = sizes.iter().sum();
        if total > MAX_OUTPUT_SCHEMAS_BYTES {
            return Err(GatewayError::invalid_field(
                "/skillOutputSchemas",
                format!(
                    "are {total} bytes as JSON in all, more than the {MAX_OUTPUT_SCHEMAS_BYTES} an agent's schemas may be"
                ),
            ));
        }
        let mut violations = Vec::new();
        for ((key, schema), bytes) in schemas.iter().zip(sizes) {
            let field = format!("/skillOutputSchemas/{}", escape(key));
            if bytes > MAX_OUTPUT_SCHEMA_BYTES {
                violations.push(FieldViolation::new(
                    field,
                    format!(
                        "is {bytes} bytes as JSON, more than the {MAX_OUTPUT_SCHEMA_BYTES} a schema may be"
                    ),
                ));
            } else if declared_skill(&view, key).is_none() {
                violations.push(FieldViolation::new(
                    field,
                    "names no skill of the card (a skill id, in any case, or {agentId}/{skillId})",
                ));
            } else if let Err(reason) = crate::schema_support::check_result_schema(schema) {
                violations.push(FieldViolation::new(field, reason));
            }
        }
        if violations.is_empty() {
            Ok(())
        } else {
            Err(GatewayError::invalid_fields(violations))
        }
    }
}

/// Params of `GetAgent` and `DeregisterAgent`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct IdParams {
    /// The agent id.
    #[serde(default)]
    pub id: String,
}

/// Params of `SearchAgents` (and the query of `GET /registry/agents`).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SearchParams {
    /// A skill id the agent declares.
    #[serde(default)]
    pub skill: Option<String>,
    /// A tag of one of its skills.
    #[serde(default)]
    pub tag: Option<String>,
    /// Words that must all appear in its names, descriptions or skills.
    #[serde(default, alias = "q")]
    pub query: Option<String>,
    /// A media type it accepts.
    #[serde(default, alias = "input_mode")]
    pub input_mode: Option<String>,
    /// A media type it produces.
    #[serde(default, alias = "output_mode")]
    pub output_mode: Option<String>,
    /// Page size, 1 to 100 (default 50).
    #[serde(
        default,
        alias = "page_size",
        deserialize_with = "crate::protocol::wire::opt_int32::deserialize"
    )]
    pub page_size: Option<i32>,
    /// Cursor from the previous page.
    #[serde(default, alias = "page_token")]
    pub page_token: Option<String>,
}

/// One page of search results.
#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SearchPage {
    /// The agents, by id.
    pub agents: Vec<AgentRecord>,
    /// Cursor of the next page; empty on the last.
    pub next_page_token: String,
}

/// The agent registry.
pub struct Registry {
    ledger: Arc<Ledger>,
    directory: Arc<Directory>,
    validator: CardValidator,
    fetcher: CardFetcher,
    connect: AgentFactory,
    // std RwLock: map operations only, never held across .await.
    records: RwLock<BTreeMap<String, AgentRecord>>,
    /// Held from a change's check (the id free, the caller its owner) to
    /// its write, so that two changes of one id cannot both pass the check.
    /// Cards are fetched before it is taken.
    changes: tokio::sync::Mutex<()>,
    /// Deregistered ids, by the agency that held them: only it may take one
    /// again, since its old tasks still name the id.
    retired: RwLock<std::collections::HashMap<String, String>>,
    /// Ids no agency may take: the tenant labels of the routing rules,
    /// which an agent of that id would take over.
    reserved: RwLock<std::collections::BTreeSet<String>>,
}

fn not_found(id: &str) -> GatewayError {
    GatewayError::invalid_field("id", format!("no agent {id:?} is registered"))
}

/// Built-in agents are public (`GetAgent` shows them), so saying so
/// reveals nothing, and "not registered" would contradict `GetAgent`.
fn built_in(id: &str) -> GatewayError {
    GatewayError::invalid_field(
        "id",
        format!(
            "{id:?} is a built-in agent of this gateway; the registry cannot take, change or remove it"
        ),
    )
}

/// Agent ids: a letter or digit, then letters, digits, `.`, `_` or `-`.
fn check_id(id: &str) -> Result<(), GatewayError> {
    let valid = !id.is_empty()
        && id.len() <= 64
        && id.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if valid {
        Ok(())
    } else {
        Err(GatewayError::invalid_field(
            "id",
            format!(
                "{id:?} is not a valid agent id (1-64 of a-z, 0-9, '.', '_', '-', starting with a letter or digit)"
            ),
        ))
    }
}

/// An id from a card name: `Billing Agent` → `billing-agent`.
fn id_from_name(name: &str) -> String {
    let mut id = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            id.push(c.to_ascii_lowercase());
        } else if !id.ends_with('-') && !id.is_empty() {
            id.push('-');
        }
    }
    let id = id.trim_end_matches('-');
    id.chars().take(64).collect()
}

impl Registry {
    /// A registry over `ledger`, routing through `directory`.
    pub fn new(
        ledger: Arc<Ledger>,
        directory: Arc<Directory>,
        fetcher: CardFetcher,
        connect: AgentFactory,
    ) -> Self {
        Self {
            ledger,
            directory,
            validator: CardValidator::new(),
            fetcher,
            connect,
            records: RwLock::new(BTreeMap::new()),
            changes: tokio::sync::Mutex::new(()),
            retired: RwLock::default(),
            reserved: RwLock::default(),
        }
    }

    /// Keeps `ids` from being registered: tenant labels of the routing rules.
    pub fn reserve_ids(&self, ids: impl IntoIterator<Item = String>) {
        self.reserved.write().expect("registry lock").extend(ids);
    }

    /// The directory the registry feeds.
    pub fn directory(&self) -> &Arc<Directory> {
        &self.directory
    }

    /// Adds a built-in agent (not stored: it exists in every run).
    pub fn add_builtin(&self, handle: AgentHandle, owner: &str) {
        let now = Utc::now();
        let card = handle.agent.card().clone();
        let entry =
            self.directory
                .upsert(&handle.id, owner, handle.agent, AgentPolicy::default(), now);
        let record = AgentRecord {
            id: handle.id.clone(),
            owner: owner.to_string(),
            card,
            published_card: entry.card.card.clone(),
            etag: entry.card.etag.clone(),
            registered_at: now,
            updated_at: now,
            health: Health::healthy(now, std::time::Duration::ZERO),
            card_url: None,
            skill_output_schemas: None,
            task_timeout_ms: None,
            max_hops: None,
            ack_timeout_ms: None,
            allow_from: None,
            builtin: true,
        };
        self.records
            .write()
            .expect("registry lock")
            .insert(handle.id, record);
    }

    /// Routes to every agent registered in earlier runs; returns how many.
    pub fn load(&self) -> Result<usize, GatewayError> {
        let retired = self.ledger.retired_agents()?;
        self.retired.write().expect("registry lock").extend(retired);
        let stored: Vec<AgentRecord> = self.ledger.agents()?;
        // Routed in one change, as each change rebuilds the gateway card.
        let mut routed = Vec::new();
        let mut loaded = Vec::new();
        for record in stored {
            if record.card.jsonrpc_interface().is_none()
                && record.card.calling_interface().is_some()
                && !record.builtin
            {
                tracing::warn!(agent = %record.id, "the agent's card has no JSON-RPC interface of protocol version 1; Baton calls its first JSON-RPC one, in 1.0: register the agent again with a 1.0 interface");
            }
            if self.is_reserved(&record.id) {
                tracing::warn!(agent = %record.id, owner = %record.owner, "the agent's id is a tenant label of the routing rules: calls with that tenant follow the rules, and the agent is reached at /agents/{{id}}/a2a only");
            }
            match (self.connect)(&record.id, &record.card) {
                Ok(agent) => {
                    routed.push(NewAgent {
                        id: record.id.clone(),
                        owner: record.owner.clone(),
                        agent,
                        policy: record.policy(),
                        modified: record.updated_at,
                    });
                    loaded.push(record);
                }
                Err(err) => {
                    tracing::error!(agent = %record.id, %err, "cannot route to a stored agent")
                }
            }
        }
        self.directory.upsert_many(routed);
        let count = loaded.len();
        let mut records = self.records.write().expect("registry lock");
        records.extend(loaded.into_iter().map(|record| (record.id.clone(), record)));
        Ok(count)
    }

    /// Registers every `*.json` card in `dir` under `owner`, skipping ids
    /// already served (the built-in agents' own cards live there too).
    pub async fn register_card_files(
        &self,
        dir: &Path,
        owner: &str,
    ) -> Result<usize, GatewayError> {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Ok(0);
        };
        let mut paths: Vec<_> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|ext| ext == "json"))
            .collect();
        paths.sort();
        // One gateway card for all the files, not one per file.
        let _batch = self.directory.batch();
        let mut registered = 0;
        for path in paths {
            let Some(id) = path
                .file_stem()
                .and_then(|s| s.to_str())
                .map(str::to_string)
            else {
                continue;
            };
            if self
                .records
                .read()
                .expect("registry lock")
                .get(&id)
                .is_some_and(|r| r.builtin)
            {
                // The built-in agents' own cards, compiled into the binary.
                tracing::info!(path = %path.display(), agent = %id, "card file skipped: a built-in agent has this id");
                continue;
            }
            // One bad file must not keep the others (or Baton) from starting.
            let card = match std::fs::read_to_string(&path)
                .map_err(|e| e.to_string())
                .and_then(|text| serde_json::from_str::<Value>(&text).map_err(|e| e.to_string()))
            {
                Ok(card) => card,
                Err(err) => {
                    tracing::error!(path = %path.display(), %err, "card not registered");
                    continue;
                }
            };
            let params = RegisterParams {
                id: Some(id.clone()),
                card: Some(card),
                ..RegisterParams::default()
            };
            let exists = self
                .records
                .read()
                .expect("registry lock")
                .contains_key(&id);
            let result = if exists {
                self.update(owner, params).await
            } else {
                self.register(owner, params).await
            };
            match result {
                Ok(_) => registered += 1,
                Err(err) => tracing::error!(path = %path.display(), %err, "card not registered"),
            }
        }
        Ok(registered)
    }

    /// The card of a register/update call, inline or fetched, validated.
    async fn resolve_card(
        &self,
        params: &RegisterParams,
    ) -> Result<(AgentCard, Option<String>), GatewayError> {
        let (json, card_url) = match (&params.card, &params.card_url) {
            (Some(card), None) => {
                // Held as large as a fetched one may be: a card is kept and
                // copied into the gateway's card, listings and searches.
                let bytes = serde_json::to_vec(card).map_or(0, |encoded| encoded.len());
                let limit = self.fetcher.max_bytes();
                if bytes > limit {
                    return Err(GatewayError::invalid_field(
                        "card",
                        format!("is {bytes} bytes as JSON, more than the {limit} a card may be"),
                    ));
                }
                (card.clone(), None)
            }
            (None, Some(url)) => {
                let fetched = self.fetcher.fetch(url).await.map_err(|err| {
                    let description = match &err {
                        FetchError::Refused(reason) => format!("not fetched: {reason}"),
                        other => other.to_string(),
                    };
                    GatewayError::invalid_field("cardUrl", description)
                })?;
                (fetched.json, Some(fetched.url.to_string()))
            }
            _ => {
                return Err(GatewayError::invalid_field(
                    "card",
                    "give exactly one of card and cardUrl",
                ));
            }
        };
        Ok((self.accept_card(&json)?, card_url))
    }

    /// A card as JSON, validated, and reachable over JSON-RPC.
    fn accept_card(&self, json: &serde_json::Value) -> Result<AgentCard, GatewayError> {
        let card = self.validator.validate(json).map_err(|violations| {
            GatewayError::invalid_fields(
                violations
                    .into_iter()
                    .map(|v| FieldViolation::new(format!("/card{}", v.field), v.description))
                    .collect(),
            )
        })?;
        require_jsonrpc(card)
    }

    /// `RegisterAgent`.
    pub async fn register(
        &self,
        owner: &str,
        params: RegisterParams,
    ) -> Result<AgentRecord, GatewayError> {
        if let Some(id) = &params.id {
            check_id(id)?;
        }
        let (card, card_url) = self.resolve_card(&params).await?;
        let _change = self.changes.lock().await;
        let id = match &params.id {
            Some(id) => id.clone(),
            None => {
                // A derived id takes the first free suffix: billing, billing-2, ...
                let base = id_from_name(&card.name);
                check_id(&base)?;
                let records = self.records.read().expect("registry lock");
                (1..)
                    .map(|n| {
                        if n == 1 {
                            base.clone()
                        } else {
                            format!("{base}-{n}")
                        }
                    })
                    .find(|id| {
                        !records.contains_key(id)
                            && !self.retired_by_another(id, owner)
                            && !self.is_reserved(id)
                    })
                    .unwrap_or(base)
            }
        };
        let taken = self
            .records
            .read()
            .expect("registry lock")
            .get(&id)
            .map(|r| r.builtin);
        if taken == Some(true) {
            return Err(built_in(&id));
        }
        if taken.is_some() || self.retired_by_another(&id, owner) {
            return Err(GatewayError::invalid_field(
                "id",
                format!(
                    "the agent id {id:?} is taken (registered, or once registered by another agency); choose another id, or UpdateAgent your own"
                ),
            ));
        }
        if self.is_reserved(&id) {
            return Err(GatewayError::invalid_field(
                "id",
                format!("the agent id {id:?} is a tenant label of the gateway's routing rules"),
            ));
        }
        let held = self
            .records
            .read()
            .expect("registry lock")
            .values()
            .filter(|record| record.owner == owner && !record.builtin)
            .count();
        if held >= MAX_AGENTS_PER_AGENCY {
            return Err(GatewayError::invalid_field(
                "id",
                format!(
                    "an agency may register at most {MAX_AGENTS_PER_AGENCY} agents; deregister one first"
                ),
            ));
        }
        params.check_output_schemas(&id, &card)?;
        let now = Utc::now();
        self.store(owner, &id, card, card_url, &params, now, now)
            .await
    }

    /// `UpdateAgent`: the caller's own agents only.
    pub async fn update(
        &self,
        owner: &str,
        params: RegisterParams,
    ) -> Result<AgentRecord, GatewayError> {
        let Some(id) = params.id.clone() else {
            return Err(GatewayError::invalid_field("id", "is required"));
        };
        // Checked before the card is fetched, to fail fast, and again with
        // the change held: it may have been deregistered (and the id taken)
        // meanwhile.
        let checked = self.owned(owner, &id)?;
        // Neither card nor cardUrl: the limits change, the card stays.
        let card = if params.card.is_none() && params.card_url.is_none() {
            None
        } else {
            Some(self.resolve_card(&params).await?)
        };
        // During a fetch, changes asked for after this one may land first:
        // the fetched card is taken only over the agent as it was checked.
        let checked_at = params.card_url.is_some().then_some(checked.updated_at);
        self.update_to(owner, &id, params, card, checked_at).await
    }

    /// Stores `card` (else the card it has) as the caller's agent `id`, with
    /// `params` over what it had; refused if the agent was changed since
    /// `checked_at`, when given.
    async fn update_to(
        &self,
        owner: &str,
        id: &str,
        params: RegisterParams,
        card: Option<(AgentCard, Option<String>)>,
        checked_at: Option<chrono::DateTime<Utc>>,
    ) -> Result<AgentRecord, GatewayError> {
        let _change = self.changes.lock().await;
        let existing = self.owned(owner, id)?;
        if checked_at.is_some_and(|at| at != existing.updated_at) {
            return Err(GatewayError::invalid_field(
                "id",
                format!(
                    "the agent {id:?} changed while its card was fetched from cardUrl (updated, or deregistered and registered again); nothing was changed: send UpdateAgent again to take the card over the agent as it is now"
                ),
            ));
        }
        let (card, card_url) =
            card.unwrap_or_else(|| (existing.card.clone(), existing.card_url.clone()));
        self.update_from(existing, params, card, card_url).await
    }

    /// A health check's update to the card its URL serves now: taken only
    /// if the agent is still as `checked` was (its owner may have changed
    /// it while the card was being fetched).
    async fn refresh_to(
        &self,
        checked: &AgentRecord,
        params: RegisterParams,
        card: AgentCard,
        card_url: Option<String>,
    ) -> Result<AgentRecord, GatewayError> {
        let _change = self.changes.lock().await;
        let existing = self.owned(&checked.owner, &checked.id)?;
        if existing.updated_at != checked.updated_at {
            return Err(GatewayError::Internal(
                "the agent was updated while its card was fetched".into(),
            ));
        }
        self.update_from(existing, params, card, card_url).await
    }

    /// Stores `card` over `existing`, keeping the limits `params` leaves out;
    /// call with `changes` held.
    async fn update_from(
        &self,
        existing: AgentRecord,
        params: RegisterParams,
        card: AgentCard,
        card_url: Option<String>,
    ) -> Result<AgentRecord, GatewayError> {
        let (owner, id) = (existing.owner.as_str(), existing.id.as_str());
        // Only the schemas given now: kept ones may outlive a skill that a
        // changed card dropped, and must not keep the card from changing.
        params.check_output_schemas(id, &card)?;
        let mut params = params;
        params.skill_output_schemas = params
            .skill_output_schemas
            .or(existing.skill_output_schemas);
        params.task_timeout_ms = params.task_timeout_ms.or(existing.task_timeout_ms);
        params.max_hops = params.max_hops.or(existing.max_hops);
        params.ack_timeout_ms = params.ack_timeout_ms.or(existing.ack_timeout_ms);
        params.allow_from = params.allow_from.or(existing.allow_from);
        self.store(
            owner,
            id,
            card,
            card_url,
            &params,
            existing.registered_at,
            Utc::now(),
        )
        .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn store(
        &self,
        owner: &str,
        id: &str,
        card: AgentCard,
        card_url: Option<String>,
        params: &RegisterParams,
        registered_at: chrono::DateTime<Utc>,
        updated_at: chrono::DateTime<Utc>,
    ) -> Result<AgentRecord, GatewayError> {
        params.check_limits()?;
        let agent = (self.connect)(id, &card)
            .map_err(|e| GatewayError::invalid_field("/card/supportedInterfaces", e))?;
        let mut record = AgentRecord {
            id: id.to_string(),
            owner: owner.to_string(),
            card,
            published_card: AgentCard::default(),
            etag: String::new(),
            registered_at,
            updated_at,
            health: Health::default(),
            card_url,
            skill_output_schemas: params.skill_output_schemas.clone(),
            task_timeout_ms: params.task_timeout_ms,
            max_hops: params.max_hops,
            ack_timeout_ms: params.ack_timeout_ms,
            allow_from: params.allow_from.clone(),
            builtin: false,
        };
        // Baton does not fetch a registered agent's extended card.
        let published_card = self.directory.publish(id, &record.card, false);
        let published = PublishedCard::new(published_card, updated_at);
        record.published_card = published.card;
        record.etag = published.etag;
        // Durable before it is routed or shown.
        self.ledger.put_agent(id, &record).await?;
        self.directory
            .upsert(id, owner, agent, record.policy(), updated_at);
        self.records
            .write()
            .expect("registry lock")
            .insert(id.to_string(), record.clone());
        tracing::info!(agent = id, owner, "agent registered");
        Ok(record)
    }

    /// Whether another agency than `owner` deregistered `id`.
    fn is_reserved(&self, id: &str) -> bool {
        self.reserved.read().expect("registry lock").contains(id)
    }

    fn retired_by_another(&self, id: &str, owner: &str) -> bool {
        self.retired
            .read()
            .expect("registry lock")
            .get(id)
            .is_some_and(|held_by| held_by != owner)
    }

    /// An agent the caller owns; others' agents are reported as not found.
    fn owned(&self, owner: &str, id: &str) -> Result<AgentRecord, GatewayError> {
        match self.records.read().expect("registry lock").get(id) {
            Some(record) if record.builtin => Err(built_in(id)),
            Some(record) if record.owner == owner => Ok(record.clone()),
            _ => Err(not_found(id)),
        }
    }

    /// `DeregisterAgent`: the caller's own agents only.
    pub async fn deregister(&self, owner: &str, id: &str) -> Result<(), GatewayError> {
        let _change = self.changes.lock().await;
        self.owned(owner, id)?;
        self.ledger.delete_agent(id, owner).await?;
        self.retired
            .write()
            .expect("registry lock")
            .insert(id.to_string(), owner.to_string());
        self.records.write().expect("registry lock").remove(id);
        self.directory.remove(id);
        tracing::info!(agent = id, owner, "agent removed");
        Ok(())
    }

    /// `GetAgent`, as `viewer` may see it: with API keys, another agency's
    /// agent as Baton serves it.
    pub fn get(&self, id: &str, viewer: &str) -> Result<AgentRecord, GatewayError> {
        let record = self
            .records
            .read()
            .expect("registry lock")
            .get(id)
            .cloned()
            .ok_or_else(|| not_found(id))?;
        Ok(self.as_served(record, viewer))
    }

    /// `record` with the card its agent is served with now: a record keeps
    /// the one published when it was stored, and the directory publishes
    /// again under another `--public-url` or once API keys appear. With API
    /// keys, an agency sees another's agent as Baton serves it: the card
    /// as published, no `cardUrl` and no health error (they name the
    /// agent's own addresses, which would let a caller go around Baton,
    /// its allow lists and its ledger).
    fn as_served(&self, mut record: AgentRecord, viewer: &str) -> AgentRecord {
        if let Some(entry) = self.directory.get(&record.id) {
            record.published_card = entry.card.card.clone();
            record.etag = entry.card.etag.clone();
        }
        if self.directory.is_secured() && record.owner != viewer {
            record.card = record.published_card.clone();
            record.card_url = None;
            record.health.error = None;
        }
        record
    }

    /// `SearchAgents`, as `viewer` may see each agent.
    pub fn search(&self, params: &SearchParams, viewer: &str) -> Result<SearchPage, GatewayError> {
        self.search_with(params, "query", viewer)
    }

    /// A search whose query text the caller gave as `query_field` (`q` in
    /// `GET /registry/agents`): the field its refusal names.
    pub fn search_with(
        &self,
        params: &SearchParams,
        query_field: &str,
        viewer: &str,
    ) -> Result<SearchPage, GatewayError> {
        let terms = query_terms(params.query.as_deref().unwrap_or_default(), query_field)?;
        let page_size = params.page_size.unwrap_or(50);
        if !(1..=100).contains(&page_size) {
            return Err(GatewayError::invalid_field(
                "pageSize",
                format!("must be between 1 and 100, got {page_size}"),
            ));
        }
        let after = match params.page_token.as_deref().filter(|t| !t.is_empty()) {
            None => None,
            Some(token) => Some(
                URL_SAFE_NO_PAD
                    .decode(token)
                    .ok()
                    .and_then(|bytes| String::from_utf8(bytes).ok())
                    .ok_or_else(|| {
                        GatewayError::invalid_field(
                            "pageToken",
                            "is not a token this server issued",
                        )
                    })?,
            ),
        };
        let records = self.records.read().expect("registry lock");
        let mut matches = records
            .values()
            .filter(|record| after.as_ref().is_none_or(|after| record.id > *after))
            .filter(|record| matches_search(&record.card, &record.id, params, &terms));
        let agents: Vec<AgentRecord> = matches.by_ref().take(page_size as usize).cloned().collect();
        let next_page_token = match (matches.next(), agents.last()) {
            (Some(_), Some(last)) => URL_SAFE_NO_PAD.encode(last.id.as_bytes()),
            _ => String::new(),
        };
        drop(records);
        Ok(SearchPage {
            agents: agents
                .into_iter()
                .map(|r| self.as_served(r, viewer))
                .collect(),
            next_page_token,
        })
    }

    /// Re-fetches every remote agent's card once and records its health; a
    /// card registered by URL that changed (and still validates) is updated.
    pub async fn check_health(&self) {
        let remote: Vec<AgentRecord> = self
            .records
            .read()
            .expect("registry lock")
            .values()
            .filter(|record| !record.builtin)
            .cloned()
            .collect();
        // Side by side, a few at a time: one at a time, each agent that
        // does not answer held every later check up for its fetch timeout.
        use futures::StreamExt as _;
        futures::stream::iter(remote)
            .for_each_concurrent(HEALTH_CHECKS_AT_ONCE, |record| self.check_one(record))
            .await;
    }

    /// Re-fetches one agent's card and records its health, unless the agent
    /// was changed meanwhile (the result is about a card or URL it left). An
    /// agent registered inline is probed at its server's origin, and is
    /// healthy if the server answers there at all.
    async fn check_one(&self, record: AgentRecord) {
        let location = record.card_url.clone().or_else(|| {
            // Where Baton calls it, not whatever interface comes first.
            let interface = record.card.calling_interface()?;
            let url = reqwest::Url::parse(&interface.url).ok()?;
            Some(url.origin().ascii_serialization())
        });
        let Some(location) = location else {
            return;
        };
        let now = Utc::now();
        // The version of the agent the result is about.
        let mut checked_at = record.updated_at;
        let started = std::time::Instant::now();
        let fetched = self.fetcher.fetch(&location).await;
        let health = match fetched {
            // An inline card needs no card from the agent's server, only an
            // answer: an agent under a sub-path of a server that serves no
            // card at its origin is up all the same.
            Err(err) if record.card_url.is_none() && server_answered(&err) => {
                Health::healthy(now, started.elapsed())
            }
            Ok(fetched) => {
                if record.card_url.is_some()
                    && let Ok(card) = self.validator.validate(&fetched.json)
                    && card != record.card
                {
                    // The card just fetched, under the URL the record keeps
                    // following (an inline card would be one of its own).
                    let taken = match require_jsonrpc(card) {
                        Ok(card) => {
                            let params = RegisterParams {
                                id: Some(record.id.clone()),
                                ..RegisterParams::default()
                            };
                            let card_url = record.card_url.clone();
                            self.refresh_to(&record, params, card, card_url).await
                        }
                        Err(err) => Err(err),
                    };
                    match taken {
                        Ok(refreshed) => checked_at = refreshed.updated_at,
                        Err(err) => {
                            tracing::warn!(agent = %record.id, %err, "changed card not taken")
                        }
                    }
                }
                Health::healthy(now, fetched.latency)
            }
            Err(err) => Health {
                status: HealthStatus::Unhealthy,
                last_checked: Some(now),
                latency_ms: None,
                error: Some(err.to_string()),
            },
        };
        // With the change lock, the record and the directory's entry are
        // the same registration.
        let _change = self.changes.lock().await;
        let mut records = self.records.write().expect("registry lock");
        match records.get_mut(&record.id) {
            Some(stored) if stored.updated_at == checked_at => {
                self.directory
                    .set_healthy(&record.id, health.status != HealthStatus::Unhealthy);
                stored.health = health;
            }
            _ => tracing::debug!(agent = %record.id, "health result dropped: the agent changed"),
        }
    }
}

/// Whether a failed card fetch still had the server answer as a live one
/// does: with a client error status (no card at that path), a body that is
/// not a card, or one too large. A server error status is not an answer.
fn server_answered(err: &FetchError) -> bool {
    match err {
        FetchError::Status { status, .. } => *status < 500,
        FetchError::NotJson { .. } | FetchError::TooLarge { .. } => true,
        FetchError::BadUrl(_) | FetchError::Refused(_) | FetchError::Unreachable { .. } => false,
    }
}

/// Most agents one agency may have registered: each is re-fetched by every
/// health check and listed in the gateway's card.
pub const MAX_AGENTS_PER_AGENCY: usize = 1000;

/// Largest `skillOutputSchemas` entry, as JSON. A schema is copied into the
/// record of every task it types, so it is held well below a card's 1 MiB;
/// 64 KiB still fits a schema of hundreds of fields.
pub const MAX_OUTPUT_SCHEMA_BYTES: usize = 64 * 1024;

/// Largest `skillOutputSchemas` of one agent in all, as JSON: kept in its
/// record and shown by `GetAgent` and searches beside the card, it is at
/// most a quarter of what the card may be.
pub const MAX_OUTPUT_SCHEMAS_BYTES: usize = 256 * 1024;

/// Most entries of `allowFrom`, each at most [`MAX_ALLOW_FROM_ID_BYTES`]:
/// the list is kept in the record and scanned on every handoff to the
/// agent, and hundreds of senders are plenty for one agent.
pub const MAX_ALLOW_FROM: usize = 512;

/// Longest `allowFrom` entry in bytes: four times a registered agent id's
/// 64, for senders named elsewhere.
pub const MAX_ALLOW_FROM_ID_BYTES: usize = 256;

/// How many agents' cards a health check fetches at once.
const HEALTH_CHECKS_AT_ONCE: usize = 8;

/// Longest search query in bytes: a search looks for each of its words in
/// the text of every registered card.
pub const MAX_QUERY_BYTES: usize = 256;

/// Most distinct words of a search query; see [`MAX_QUERY_BYTES`].
pub const MAX_QUERY_TERMS: usize = 8;

/// The distinct words of a search query, lowercased; a query past the
/// bounds is refused naming `field`.
fn query_terms(query: &str, field: &str) -> Result<Vec<String>, GatewayError> {
    if query.len() > MAX_QUERY_BYTES {
        return Err(GatewayError::invalid_field(
            field,
            format!(
                "is {} bytes, more than the {MAX_QUERY_BYTES} a search query may be",
                query.len()
            ),
        ));
    }
    let mut terms: Vec<String> = Vec::new();
    for term in query.split_whitespace().map(str::to_lowercase) {
        if !terms.contains(&term) {
            terms.push(term);
        }
    }
    if terms.len() > MAX_QUERY_TERMS {
        return Err(GatewayError::invalid_field(
            field,
            format!(
                "has {} distinct words, more than the {MAX_QUERY_TERMS} a search may look for",
                terms.len()
            ),
        ));
    }
    Ok(terms)
}

/// Whether a card matches every given search filter; `terms` are the
/// query's, from [`query_terms`].
fn matches_search(card: &AgentCard, id: &str, params: &SearchParams, terms: &[String]) -> bool {
    let eq = |a: &str, b: &str| a.eq_ignore_ascii_case(b);
    if let Some(skill) = &params.skill
        && !card.skills.iter().any(|s| eq(&s.id, skill))
    {
        return false;
    }
    if let Some(tag) = &params.tag
        && !card.skills.iter().flat_map(|s| &s.tags).any(|t| eq(t, tag))
    {
        return false;
    }
    let modes_match =
        |wanted: &Option<String>, card_modes: &[String], skill_modes: Vec<&String>| {
            wanted.as_ref().is_none_or(|wanted| {
                card_modes
                    .iter()
                    .chain(skill_modes)
                    .any(|mode| media_type_matches(mode, wanted))
            })
        };
    let skill_inputs = card.skills.iter().flat_map(|s| &s.input_modes).collect();
    if !modes_match(&params.input_mode, &card.default_input_modes, skill_inputs) {
        return false;
    }
    let skill_outputs = card.skills.iter().flat_map(|s| &s.output_modes).collect();
    if !modes_match(
        &params.output_mode,
        &card.default_output_modes,
        skill_outputs,
    ) {
        return false;
    }
    if !terms.is_empty() {
        let mut text = format!("{id} {} {}", card.name, card.description);
        for skill in &card.skills {
            text.push(' ');
            text.push_str(&[skill.id.as_str(), &skill.name, &skill.description].join(" "));
            for word in skill.tags.iter().chain(&skill.examples) {
                text.push(' ');
                text.push_str(word);
            }
        }
        let text = text.to_lowercase();
        if !terms.iter().all(|term| text.contains(term.as_str())) {
            return false;
        }
    }
    true
}

/// `card`, if Baton can reach its agent: over JSON-RPC, protocol version 1.
fn require_jsonrpc(card: AgentCard) -> Result<AgentCard, GatewayError> {
    if card.jsonrpc_interface().is_none() {
        return Err(GatewayError::invalid_field(
            "/card/supportedInterfaces",
            "Baton reaches agents over JSON-RPC, protocol version 1.x: declare a JSONRPC \
             interface with protocolVersion 1.0",
        ));
    }
    Ok(card)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netguard::OutboundPolicy;

    /// A registry over a fresh ledger, and its ledger.
    fn registry_in(dir: &Path) -> (Arc<Ledger>, Registry) {
        let ledger = Arc::new(Ledger::open(dir).unwrap());
        (ledger.clone(), registry_over(ledger))
    }

    /// A registry, with an empty directory, over `ledger`.
    fn registry_over(ledger: Arc<Ledger>) -> Registry {
        let policy = OutboundPolicy::default();
        let directory = Arc::new(Directory::new("http://localhost:8080", true));
        let fetcher = CardFetcher::new(policy.clone(), std::time::Duration::from_secs(1), 1 << 20);
        Registry::new(
            ledger,
            directory,
            fetcher,
            crate::launch::remote_agents(policy),
        )
    }

    /// A registration of agent `billing` with a valid inline card.
    fn billing_params() -> RegisterParams {
        let card = serde_json::json!({
            "name": "Billing", "description": "Refunds.", "version": "1.0.0",
            "supportedInterfaces": [{"url": "https://billing.example/a2a",
                "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}],
            "capabilities": {}, "defaultInputModes": ["text/plain"],
            "defaultOutputModes": ["text/plain"],
            "skills": [{"id": "refund", "name": "Refund", "description": "Refunds.", "tags": ["refunds"]}],
        });
        RegisterParams {
            id: Some("billing".into()),
            card: Some(card),
            ..RegisterParams::default()
        }
    }

    /// An inline card is held to the size a fetched one may have.
    #[tokio::test]
    async fn an_inline_card_larger_than_a_fetched_one_may_be_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, registry) = registry_in(dir.path());
        let mut params = billing_params();
        let card = params.card.as_mut().unwrap();
        card["description"] = "x".repeat(1 << 20).into();
        let refused = registry.register("acme", params).await.unwrap_err();
        let says = refused.to_rpc_error().to_string();
        assert!(
            says.contains("more than the 1048576 a card may be"),
            "{says}"
        );
        assert!(registry.directory().get("billing").is_none());
        registry.register("acme", billing_params()).await.unwrap();
        ledger.close();
    }

    /// The violated fields of a refusal, in order.
    fn fields_of(refused: &GatewayError) -> Vec<String> {
        let error = refused.to_rpc_error();
        assert_eq!(error["code"], -32602, "{error}");
        let violations = error["data"][0]["fieldViolations"].as_array().unwrap();
        let fields = violations.iter().map(|v| v["field"].as_str().unwrap());
        fields.map(str::to_string).collect()
    }

    /// `billing_params()` with `schemas` as its `skillOutputSchemas`.
    fn billing_with_schemas(schemas: Value) -> RegisterParams {
        RegisterParams {
            skill_output_schemas: schemas.as_object().cloned(),
            ..billing_params()
        }
    }

    /// An output schema that does not compile, or whose key names no skill
    /// of the card, is refused at registration, not when a task completes.
    #[tokio::test]
    async fn output_schemas_that_cannot_check_a_result_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, registry) = registry_in(dir.path());
        let object = serde_json::json!({"type": "object"});
        let cases = [
            (serde_json::json!({"refund": {"type": 12}}), "refund"),
            (serde_json::json!({"refunds": object}), "refunds"),
            (
                serde_json::json!({"triage/refund": object}),
                "triage~1refund",
            ),
        ];
        for (schemas, key) in cases {
            let params = billing_with_schemas(schemas);
            let refused = registry.register("acme", params).await.unwrap_err();
            let field = format!("/skillOutputSchemas/{key}");
            assert_eq!(fields_of(&refused), [field]);
        }
        assert!(registry.directory().get("billing").is_none());
        // Every spelling the relay finds a schema by is taken.
        let spellings = serde_json::json!({"refund": object, "REFUND": true, "billing/Refund": {}});
        registry
            .register("acme", billing_with_schemas(spellings))
            .await
            .unwrap();

        // An update's schemas are checked against the card it keeps.
        let update = |schemas: Value| RegisterParams {
            id: Some("billing".into()),
            card: None,
            ..billing_with_schemas(schemas)
        };
        let bad = serde_json::json!({"refund": {"minimum": "zero"}, "credit": object});
        let refused = registry.update("acme", update(bad)).await.unwrap_err();
        let fields = ["/skillOutputSchemas/credit", "/skillOutputSchemas/refund"];
        assert_eq!(fields_of(&refused), fields);
        // A new card without a skill the kept schemas name is taken.
        let mut renamed = billing_params();
        renamed.card.as_mut().unwrap()["skills"][0]["id"] = "credit".into();
        registry.update("acme", renamed).await.unwrap();
        ledger.close();
    }

    /// Output schemas and the allow list are bounded, each refusal naming
    /// the field; at the bounds they are taken.
    #[tokio::test]
    async fn output_schemas_and_allow_lists_past_their_bounds_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, registry) = registry_in(dir.path());
        // `{"description":"xx…"}`, `bytes` long as JSON.
        let schema_of = |bytes: usize| serde_json::json!({"description": "x".repeat(bytes - 18)});
        assert_eq!(serde_json::to_vec(&schema_of(100)).unwrap().len(), 100);
        let one = serde_json::json!({"refund": schema_of(MAX_OUTPUT_SCHEMA_BYTES + 1)});
        let refused = registry
            .register("acme", billing_with_schemas(one))
            .await
            .unwrap_err();
        assert_eq!(fields_of(&refused), ["/skillOutputSchemas/refund"]);
        // Five spellings of the skill, each within the bound, past it in all.
        let spellings = [
            "refund",
            "Refund",
            "REFUND",
            "billing/refund",
            "billing/REFUND",
        ];
        let many: Map<String, Value> = spellings
            .iter()
            .map(|key| (key.to_string(), schema_of(MAX_OUTPUT_SCHEMA_BYTES)))
            .collect();
        let refused = registry
            .register("acme", billing_with_schemas(Value::Object(many)))
            .await
            .unwrap_err();
        assert_eq!(fields_of(&refused), ["/skillOutputSchemas"]);

        let with_allowed = |allowed: Vec<String>| RegisterParams {
            allow_from: Some(allowed),
            ..billing_params()
        };
        let senders = |n: usize| (0..n).map(|i| format!("sender-{i}")).collect();
        let refused = registry
            .register("acme", with_allowed(senders(MAX_ALLOW_FROM + 1)))
            .await
            .unwrap_err();
        assert_eq!(fields_of(&refused), ["allowFrom"]);
        let long = vec!["a".into(), "b".repeat(MAX_ALLOW_FROM_ID_BYTES + 1)];
        let refused = registry
            .register("acme", with_allowed(long))
            .await
            .unwrap_err();
        assert_eq!(fields_of(&refused), ["allowFrom[1]"]);
        assert!(registry.directory().get("billing").is_none());

        let mut at_bounds = with_allowed(senders(MAX_ALLOW_FROM));
        let four = &spellings[..4];
        let schemas = four
            .iter()
            .map(|key| (key.to_string(), schema_of(MAX_OUTPUT_SCHEMA_BYTES)));
        at_bounds.skill_output_schemas = Some(schemas.collect());
        registry.register("acme", at_bounds).await.unwrap();
        ledger.close();
    }

    /// A search query is bounded in bytes and in distinct words, refused
    /// past them naming the query; a word repeated, in any case, counts once.
    #[tokio::test]
    async fn search_queries_past_their_bounds_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, registry) = registry_in(dir.path());
        registry.register("acme", billing_params()).await.unwrap();
        let query = |text: &str| SearchParams {
            query: Some(text.to_string()),
            ..SearchParams::default()
        };
        let long = "refund ".repeat(MAX_QUERY_BYTES / 7 + 1);
        let refused = registry.search(&query(&long), "anonymous").unwrap_err();
        assert_eq!(fields_of(&refused), ["query"]);
        let nine_words = "a b c d e f g h i";
        let refused = registry
            .search(&query(nine_words), "anonymous")
            .unwrap_err();
        assert_eq!(fields_of(&refused), ["query"]);
        // As `GET /registry/agents` calls it: its parameter is `q`.
        let refused = registry
            .search_with(&query(nine_words), "q", "anonymous")
            .unwrap_err();
        assert_eq!(fields_of(&refused), ["q"]);

        let repeated = "Refund refund REFUND billing ".repeat(8);
        assert!(repeated.len() <= MAX_QUERY_BYTES);
        let found = registry.search(&query(&repeated), "anonymous").unwrap();
        let ids: Vec<&str> = found.agents.iter().map(|a| a.id.as_str()).collect();
        assert_eq!(ids, ["billing"]);
        ledger.close();
    }

    /// An agent is routed to, and its card served, only once its
    /// registration is durable.
    #[tokio::test]
    async fn an_agent_is_routable_only_once_its_registration_is_durable() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, registry) = registry_in(dir.path());
        let params = billing_params();

        let hold = ledger.hold_log();
        let register = registry.register("acme", params);
        tokio::pin!(register);
        let waited = tokio::time::timeout(std::time::Duration::from_millis(100), &mut register);
        let waited = waited.await;
        assert!(
            waited.is_err(),
            "the registration waits on the log: {waited:?}"
        );
        assert!(
            registry.directory().get("billing").is_none(),
            "not routed yet"
        );
        drop(hold);
        register.await.unwrap();
        assert!(registry.directory().get("billing").is_some());
        ledger.close();
    }

    /// A card stored before registration required a version-1 JSON-RPC
    /// interface is still routed after a restart.
    #[tokio::test]
    async fn a_stored_agent_with_an_older_interface_keeps_its_route() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, registry) = registry_in(dir.path());
        let params = billing_params();
        registry.register("acme", params).await.unwrap();
        let mut stored: Vec<AgentRecord> = ledger.agents().unwrap();
        let mut record = stored.pop().unwrap();
        record.card.supported_interfaces[0].protocol_version = "0.3".into();
        ledger.put_agent("billing", &record).await.unwrap();

        let restarted = registry_over(ledger.clone());
        assert_eq!(restarted.load().unwrap(), 1);
        assert!(restarted.directory().get("billing").is_some());
        ledger.close();
    }

    /// Start-up builds the gateway card once for all the stored agents and
    /// once for all the card files, not once for each agent.
    #[tokio::test]
    async fn start_up_builds_the_gateway_card_once() {
        let dir = tempfile::tempdir().unwrap();
        let (ledger, registry) = registry_in(dir.path());
        for n in 0..20 {
            let params = RegisterParams {
                id: Some(format!("billing-{n}")),
                ..billing_params()
            };
            registry.register("acme", params).await.unwrap();
        }
        let restarted = registry_over(ledger.clone());
        let directory = restarted.directory().clone();
        let built = directory.gateway_cards_built();
        assert_eq!(restarted.load().unwrap(), 20);
        assert_eq!(directory.gateway_cards_built() - built, 1);
        assert_eq!(directory.gateway_card().card.skills.len(), 20);

        let files = tempfile::tempdir().unwrap();
        let card = billing_params().card.unwrap().to_string();
        for n in 0..5 {
            let path = files.path().join(format!("local-{n}.json"));
            std::fs::write(path, &card).unwrap();
        }
        let built = directory.gateway_cards_built();
        let registered = restarted.register_card_files(files.path(), "local");
        assert_eq!(registered.await.unwrap(), 5);
        assert_eq!(directory.gateway_cards_built() - built, 1);
        assert_eq!(directory.gateway_card().card.skills.len(), 25);
        ledger.close();
    }

    #[test]
    fn ids() {
        assert_eq!(id_from_name("Billing Agent (EU)"), "billing-agent-eu");
        assert!(check_id("billing-agent").is_ok());
        assert!(check_id("-x").is_err());
        assert!(check_id("a/b").is_err());
        assert!(check_id("").is_err());
    }
}
