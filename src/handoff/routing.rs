//! Routing rules (DESIGN.md §5): which agent serves a `POST /a2a` request
//! whose `params.tenant` names no agent and whose message carries no handoff
//! payload (a payload names its own target, `to` or `toSkill`, §3.3).
//!
//! [`RoutingRules::route`] is a pure function of the request, a snapshot of
//! the agents and a balancing seed: no I/O, no clock, no globals. Rules are
//! tried in order and the first that matches, and whose target exists, wins.
//! `None` means no rule applied: the caller then uses the default agent.
//!
//! # Configuration: `[[route]]` tables in `baton.toml`
//!
//! ```toml
//! [[route]]                                 # route[0]
//! when.skill = "refund"                     # no `to`: balanced among the
//!                                           # agents declaring `refund`
//! [[route]]                                 # route[1]
//! when.tag = "legal"                        # the requested skill, where an
//!                                           # agent declares it with tag `legal`
//! [[route]]                                 # route[2]
//! when.tenant = "acme"
//! to.agent = "acme-support"
//!
//! [[route]]                                 # route[3]
//! when.metadata = { "customer.tier" = "gold", region = ["eu", "uk"] }
//! to.agent = "vip-desk"
//!
//! [[route]]                                 # route[4]
//! when.text = '(?i)\b(invoice|refund)\b'
//! to.skill = "billing"
//! ```
//!
//! A rule's `when` holds one or more matchers, and all of them must hold:
//! - `skill`: the request asks for this skill id. The requested skill is the
//!   string [`SKILL_KEY`] (`"skill"`) in the request's `params.metadata`, else
//!   in `message.metadata`. It is not read from the handoff control metadata
//!   (§3.1 defines no such field there). Skill ids compare ignoring ASCII
//!   case, as the registry search does. An agent declares a skill when its
//!   card lists that id, or when the id is qualified as `{agentId}/{skillId}`,
//!   the form the gateway's own card advertises, and names that agent.
//! - `tag`: the request asks for a skill that some agent declares with this
//!   tag (ignoring ASCII case). Without a skill there is no tag to match.
//! - `tenant`: `params.tenant` is exactly this. A tenant that names an agent is
//!   routed to it before any rule runs (§1), so this matches tenant labels.
//! - `metadata`: every `path = value` holds in `message.metadata` or in
//!   `params.metadata`. Paths are dotted (`customer.tier`); keys that contain
//!   dots are found too, and nested TOML tables are flattened into paths.
//!   Values are strings, numbers (`1` equals `1.0`: protobuf SDKs send
//!   doubles) or booleans. A list in the rule means any of its items, and a
//!   list in the request matches when any of its items does.
//! - `text`: a regular expression (`regex` crate syntax, compiled once at
//!   load) that matches within at least one text part of the message.
//!
//! Its `to` names the target:
//! - `to.agent`: that agent, healthy or not, because the rule pins it. When no
//!   such agent is registered, the rule is skipped.
//! - `to.skill`: one of the agents declaring that skill, chosen as described
//!   below. When no agent declares it, the rule is skipped.
//! - no `to`: allowed only with `when.skill` or `when.tag`. The target is the
//!   requested skill, among the agents declaring it (with the tag, if any).
//!
//! A skill target picks among the healthy agents declaring the skill, sorted by
//! id. Unhealthy agents are used only when none is healthy. The caller passes
//! a counter as `balance_seed`, and the pick is `seed % count`, so it goes
//! round-robin. [`Routed::skill`] records that an agent was chosen by skill.
//! A call a rule routes is a handoff (DESIGN.md §3.3) with the failure
//! ladder, and one chosen by skill may be rerouted by that skill; a call
//! that falls through to the default agent is a plain call.
//!
//! [`RoutingRules::compile`] reports every bad rule at once. Each message
//! starts with `route[i]`, where `i` is the 0-based index of the `[[route]]`
//! table.
//!
//! # Where it runs
//! `Config::load` compiles the tables, reporting every error at once. The
//! gateway asks the rules for each send on `/a2a` that names no agent and
//! carries no payload (`route` in `gateway/send.rs`); a `params.tenant`
//! that names no agent reaches them as [`RouteInput::tenant`] when some
//! rule matches it ([`RoutingRules::names_tenant`]), and is refused
//! otherwise. `None` leaves the call to the default agent.

use crate::protocol::wire::Struct;
use crate::protocol::{AgentCard, AgentSkill, Message, Part};
use regex::Regex;
use serde::Deserialize;
use serde_json::{Map, Value};

/// The metadata key (in `params.metadata`, else `message.metadata`) whose
/// string value is the skill id a request asks for.
pub const SKILL_KEY: &str = "skill";

/// One `[[route]]` table in `baton.toml`: when it applies and where it sends
/// the request.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct RouteRule {
    /// The matchers, all of which must hold. At least one is required. The
    /// default lets a missing `when` be reported by `compile` with the others.
    #[serde(default)]
    pub when: Match,
    /// Where a matching request goes. It may be left out only when `when`
    /// names a skill or a tag.
    #[serde(default)]
    pub to: Target,
}

/// The `when` of a rule. Every matcher given must hold.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Match {
    /// The skill id the request asks for (see [`SKILL_KEY`]).
    pub skill: Option<String>,
    /// A tag on the requested skill, as some agent declares it.
    pub tag: Option<String>,
    /// The request's `params.tenant`, exactly.
    pub tenant: Option<String>,
    /// Dotted path to the wanted value (or a list of values, any of which may
    /// match), in `message.metadata` or `params.metadata`.
    pub metadata: Option<Map<String, Value>>,
    /// A regular expression searched in each text part of the message.
    pub text: Option<String>,
}

/// The `to` of a rule: exactly one of `agent` or `skill`, or neither when the
/// rule matches a skill or tag.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Target {
    /// This agent id.
    pub agent: Option<String>,
    /// Any agent declaring this skill id, balanced (healthy ones first).
    pub skill: Option<String>,
}

/// The rules, validated and with their regexes compiled, in order.
#[derive(Clone, Debug, Default)]
pub struct RoutingRules {
    rules: Vec<CompiledRule>,
}

/// One validated rule.
#[derive(Clone, Debug)]
pub struct CompiledRule {
    skill: Option<String>,
    tag: Option<String>,
    tenant: Option<String>,
    /// Flattened `(dotted path, acceptable values)`.
    metadata: Vec<(String, Vec<Value>)>,
    text: Option<Regex>,
    to: CompiledTarget,
}

#[derive(Clone, Debug)]
enum CompiledTarget {
    Agent(String),
    Skill(String),
    /// The requested skill, from agents declaring it with the rule's tag, if any.
    Requested,
}

/// What routing looks at in a request.
#[derive(Clone, Copy, Debug)]
pub struct RouteInput<'a> {
    /// `params.tenant`. An empty string counts as no tenant.
    pub tenant: Option<&'a str>,
    /// `params.message`.
    pub message: &'a Message,
    /// `params.metadata`.
    pub metadata: Option<&'a Struct>,
}

/// An agent as routing sees it.
#[derive(Clone, Copy, Debug)]
pub struct AgentView<'a> {
    /// The agent id.
    pub id: &'a str,
    /// Its card (the published one: skills are the agency's, unchanged).
    pub card: &'a AgentCard,
    /// Whether it may be chosen ahead of unhealthy agents declaring a skill.
    pub healthy: bool,
}

/// A routing decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routed {
    /// The chosen agent id.
    pub agent: String,
    /// The skill the agent was chosen by, if any: a reroute may choose
    /// another agent declaring it.
    pub skill: Option<String>,
    /// Index of the rule that decided.
    pub rule: usize,
}

impl RoutingRules {
    /// Validates `raw` (the `[[route]]` tables in order). All errors are
    /// returned at once, each prefixed with `route[i]`.
    pub fn compile(raw: &[RouteRule]) -> Result<Self, Vec<String>> {
        let mut errors = Vec::new();
        let mut rules = Vec::with_capacity(raw.len());
        for (index, rule) in raw.iter().enumerate() {
            match compile_rule(rule) {
                Ok(rule) => rules.push(rule),
                Err(bad) => errors.extend(bad.into_iter().map(|e| format!("route[{index}]: {e}"))),
            }
        }
        if errors.is_empty() {
            Ok(Self { rules })
        } else {
            Err(errors)
        }
    }

    /// The tenant labels the rules match.
    pub fn tenant_labels(&self) -> impl Iterator<Item = &str> {
        self.rules.iter().filter_map(|rule| rule.tenant.as_deref())
    }

    /// Whether some rule matches `params.tenant` = `label` (a tenant that
    /// names no agent is refused unless one does).
    pub fn names_tenant(&self, label: &str) -> bool {
        self.rules
            .iter()
            .any(|rule| rule.tenant.as_deref() == Some(label))
    }

    /// How many rules there are.
    pub fn len(&self) -> usize {
        self.rules.len()
    }

    /// Whether there are no rules (every request then goes to the default agent).
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The agent id for `request`, or `None` for the default agent.
    pub fn route(
        &self,
        request: &RouteInput<'_>,
        agents: &[AgentView<'_>],
        balance_seed: u64,
    ) -> Option<String> {
        self.decide(request, agents, balance_seed)
            .map(|routed| routed.agent)
    }

    /// Like [`route`](Self::route), but also gives the deciding rule and the
    /// skill the agent was chosen by.
    pub fn decide(
        &self,
        request: &RouteInput<'_>,
        agents: &[AgentView<'_>],
        balance_seed: u64,
    ) -> Option<Routed> {
        let requested = requested_skill(request);
        self.rules.iter().enumerate().find_map(|(index, rule)| {
            if !rule.matches(request, requested, agents) {
                return None;
            }
            let (agent, skill) = rule.target(requested, agents, balance_seed)?;
            Some(Routed {
                agent: agent.to_owned(),
                skill,
                rule: index,
            })
        })
    }
}

impl CompiledRule {
    fn matches(
        &self,
        request: &RouteInput<'_>,
        requested: Option<&str>,
        agents: &[AgentView<'_>],
    ) -> bool {
        if let Some(skill) = &self.skill
            && !requested.is_some_and(|r| r.eq_ignore_ascii_case(skill))
        {
            return false;
        }
        if let Some(tenant) = &self.tenant
            && request.tenant != Some(tenant.as_str())
        {
            return false;
        }
        if let Some(tag) = &self.tag {
            let Some(requested) = requested else {
                return false;
            };
            if !agents.iter().any(|a| declares(a, requested, Some(tag))) {
                return false;
            }
        }
        let sources = [request.message.metadata.as_ref(), request.metadata];
        let metadata_holds = self.metadata.iter().all(|(path, wanted)| {
            sources
                .iter()
                .flatten()
                .any(|map| path_matches(map, path, wanted))
        });
        if !metadata_holds {
            return false;
        }
        if let Some(text) = &self.text {
            return request
                .message
                .parts
                .iter()
                .filter_map(Part::as_text)
                .any(|t| text.is_match(t));
        }
        true
    }

    /// The chosen agent and the skill it was chosen by, or `None` when the
    /// target does not exist (the rule is then skipped).
    fn target<'a>(
        &self,
        requested: Option<&str>,
        agents: &[AgentView<'a>],
        seed: u64,
    ) -> Option<(&'a str, Option<String>)> {
        let (skill, tag) = match &self.to {
            CompiledTarget::Agent(id) => {
                return agents.iter().find(|a| a.id == id).map(|a| (a.id, None));
            }
            CompiledTarget::Skill(skill) => (skill.as_str(), None),
            CompiledTarget::Requested => (requested?, self.tag.as_deref()),
        };
        let pool = candidates(agents, |a| declares(a, skill, tag));
        let agent = pick(&pool, seed)?;
        Some((agent, Some(skill.to_owned())))
    }
}

/// The agents a request for `skill` may go to: the healthy agents declaring
/// it, or, when none is healthy, all agents declaring it, sorted by id. This is
/// the pool [`RoutingRules::route`] balances over. The failure ladder drops the
/// agent that failed and tries the next.
pub fn agents_with_skill<'a>(skill: &str, agents: &[AgentView<'a>]) -> Vec<&'a str> {
    candidates(agents, |a| declares_skill(a, skill))
}

/// Whether `agent` declares `skill` (its own id, or `{agentId}/{skillId}`).
pub fn declares_skill(agent: &AgentView<'_>, skill: &str) -> bool {
    declares(agent, skill, None)
}

/// The skill id a request asks for: `params.metadata.skill`, else
/// `message.metadata.skill` (a non-blank string, trimmed).
pub fn requested_skill<'a>(request: &RouteInput<'a>) -> Option<&'a str> {
    [request.metadata, request.message.metadata.as_ref()]
        .into_iter()
        .flatten()
        .find_map(|map| {
            let skill = map.get(SKILL_KEY)?.as_str()?.trim();
            (!skill.is_empty()).then_some(skill)
        })
}

/// Healthy agents accepted by `accept`, or all accepted ones when none is
/// healthy, sorted by id.
fn candidates<'a>(
    agents: &[AgentView<'a>],
    accept: impl Fn(&AgentView<'a>) -> bool,
) -> Vec<&'a str> {
    let accepted: Vec<&AgentView<'a>> = agents.iter().filter(|a| accept(a)).collect();
    let any_healthy = accepted.iter().any(|a| a.healthy);
    let mut ids: Vec<&'a str> = accepted
        .iter()
        .filter(|a| a.healthy || !any_healthy)
        .map(|a| a.id)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

fn pick<'a>(pool: &[&'a str], seed: u64) -> Option<&'a str> {
    let len = u64::try_from(pool.len()).ok().filter(|&n| n > 0)?;
    let index = usize::try_from(seed % len).ok()?;
    pool.get(index).copied()
}

/// Whether `agent` declares `skill` (plain or `{agentId}/{skillId}`), with
/// `tag` when one is given.
fn declares(agent: &AgentView<'_>, skill: &str, tag: Option<&str>) -> bool {
    declared_skill(agent, skill).is_some_and(|declared| {
        tag.is_none_or(|tag| declared.tags.iter().any(|t| t.eq_ignore_ascii_case(tag)))
    })
}

/// The skill of `agent`'s card that `skill` names (plain, in any case, or
/// `{agentId}/{skillId}`).
pub(crate) fn declared_skill<'c>(agent: &AgentView<'c>, skill: &str) -> Option<&'c AgentSkill> {
    let local = match skill.split_once('/') {
        Some((id, local)) if id == agent.id => Some(local),
        _ => None,
    };
    agent.card.skills.iter().find(|s| {
        s.id.eq_ignore_ascii_case(skill) || local.is_some_and(|l| s.id.eq_ignore_ascii_case(l))
    })
}

/// Whether the value at dotted `path` in `map` equals one of `wanted`. Each
/// step tries the longest key first, so keys that contain dots are found.
fn path_matches(map: &Map<String, Value>, path: &str, wanted: &[Value]) -> bool {
    if let Some(found) = map.get(path)
        && value_matches(found, wanted)
    {
        return true;
    }
    path.rmatch_indices('.').any(|(dot, _)| {
        map.get(&path[..dot])
            .and_then(Value::as_object)
            .is_some_and(|inner| path_matches(inner, &path[dot + 1..], wanted))
    })
}

fn value_matches(found: &Value, wanted: &[Value]) -> bool {
    match found {
        Value::Array(items) => items.iter().any(|item| value_matches(item, wanted)),
        found => wanted.iter().any(|w| scalar_eq(found, w)),
    }
}

fn scalar_eq(found: &Value, wanted: &Value) -> bool {
    match (found, wanted) {
        // Integers compare exactly; a double on either side compares as f64.
        (Value::Number(a), Value::Number(b)) if a.is_f64() || b.is_f64() => {
            a.as_f64() == b.as_f64()
        }
        (a, b) => a == b,
    }
}

fn compile_rule(rule: &RouteRule) -> Result<CompiledRule, Vec<String>> {
    let mut errors = Vec::new();
    let when = &rule.when;
    if when.skill.is_none()
        && when.tag.is_none()
        && when.tenant.is_none()
        && when.metadata.is_none()
        && when.text.is_none()
    {
        errors.push("when: needs at least one of skill, tag, tenant, metadata, text".to_owned());
    }
    let skill = non_blank("when.skill", when.skill.as_deref(), &mut errors);
    let tag = non_blank("when.tag", when.tag.as_deref(), &mut errors);
    let tenant = non_blank("when.tenant", when.tenant.as_deref(), &mut errors);

    let mut metadata = Vec::new();
    if let Some(map) = &when.metadata {
        flatten_metadata("", map, &mut metadata, &mut errors);
    }

    let text = match when.text.as_deref() {
        None => None,
        Some("") => {
            errors.push("when.text: must not be empty".to_owned());
            None
        }
        Some(pattern) => match Regex::new(pattern) {
            Ok(regex) => Some(regex),
            Err(err) => {
                errors.push(format!(
                    "when.text: invalid regex {pattern:?}: {}",
                    regex_reason(&err)
                ));
                None
            }
        },
    };

    let to = match (&rule.to.agent, &rule.to.skill) {
        (Some(_), Some(_)) => {
            errors.push("to: set agent or skill, not both".to_owned());
            None
        }
        (Some(agent), None) => {
            non_blank("to.agent", Some(agent), &mut errors).map(CompiledTarget::Agent)
        }
        (None, Some(skill)) => {
            non_blank("to.skill", Some(skill), &mut errors).map(CompiledTarget::Skill)
        }
        (None, None) if when.skill.is_some() || when.tag.is_some() => {
            Some(CompiledTarget::Requested)
        }
        (None, None) => {
            errors.push(
                "to: needs agent or skill (only a rule matching a skill or tag may omit it)"
                    .to_owned(),
            );
            None
        }
    };

    match to {
        Some(to) if errors.is_empty() => Ok(CompiledRule {
            skill,
            tag,
            tenant,
            metadata,
            text,
            to,
        }),
        _ => Err(errors),
    }
}

fn non_blank(field: &str, value: Option<&str>, errors: &mut Vec<String>) -> Option<String> {
    let value = value?.trim();
    if value.is_empty() {
        errors.push(format!("{field}: must not be empty"));
        return None;
    }
    Some(value.to_owned())
}

/// Flattens nested tables into `(dotted path, acceptable values)`.
fn flatten_metadata(
    prefix: &str,
    map: &Map<String, Value>,
    out: &mut Vec<(String, Vec<Value>)>,
    errors: &mut Vec<String>,
) {
    let at = |path: &str| {
        if path.is_empty() {
            "when.metadata".to_owned()
        } else {
            format!("when.metadata.{path}")
        }
    };
    if map.is_empty() {
        errors.push(format!("{}: must not be empty", at(prefix)));
        return;
    }
    for (key, value) in map {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        if key.split('.').any(|segment| segment.trim().is_empty()) {
            errors.push(format!("{}: {key:?} is not a dotted path", at(prefix)));
            continue;
        }
        match value {
            Value::Object(inner) => flatten_metadata(&path, inner, out, errors),
            Value::Array(items) if items.is_empty() => {
                errors.push(format!("{}: the list of values is empty", at(&path)));
            }
            Value::Array(items) if items.iter().all(is_scalar) => out.push((path, items.clone())),
            value if is_scalar(value) => out.push((path, vec![value.clone()])),
            _ => errors.push(format!(
                "{}: must be a string, number or boolean, or a list of them",
                at(&path)
            )),
        }
    }
}

fn is_scalar(value: &Value) -> bool {
    matches!(value, Value::String(_) | Value::Number(_) | Value::Bool(_))
}

/// The one-line reason of a regex error (its `Display` spans several lines).
fn regex_reason(err: &regex::Error) -> String {
    let text = err.to_string();
    text.lines()
        .find_map(|line| line.strip_prefix("error: "))
        .map_or_else(
            || text.lines().last().unwrap_or_default().trim().to_owned(),
            str::to_owned,
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The `[[route]]` tables of a `baton.toml`, as the config will hold them.
    #[derive(Deserialize)]
    struct File {
        #[serde(default)]
        route: Vec<RouteRule>,
    }

    fn parse(toml_text: &str) -> Vec<RouteRule> {
        toml::from_str::<File>(toml_text)
            .unwrap_or_else(|e| panic!("bad test TOML: {e}\n{toml_text}"))
            .route
    }

    fn rules(toml_text: &str) -> RoutingRules {
        RoutingRules::compile(&parse(toml_text))
            .unwrap_or_else(|e| panic!("rules do not compile: {e:?}\n{toml_text}"))
    }

    fn skill(id: &str, tags: &[&str]) -> AgentSkill {
        AgentSkill {
            id: id.to_owned(),
            name: id.to_owned(),
            tags: tags.iter().map(|t| (*t).to_owned()).collect(),
            ..AgentSkill::default()
        }
    }

    /// `(id, card, healthy)` for every test agent.
    fn fleet() -> Vec<(&'static str, AgentCard, bool)> {
        let card = |skills: Vec<AgentSkill>| AgentCard {
            skills,
            ..AgentCard::default()
        };
        vec![
            (
                "billing",
                card(vec![
                    skill("refund", &["finance", "money"]),
                    skill("invoice", &["finance"]),
                ]),
                true,
            ),
            ("billing-2", card(vec![skill("refund", &["finance"])]), true),
            ("billing-3", card(vec![skill("Refund", &[])]), true),
            ("legal", card(vec![skill("summarize", &["Legal"])]), true),
            (
                "general",
                card(vec![skill("summarize", &["general"])]),
                true,
            ),
            ("archive-1", card(vec![skill("archive", &[])]), false),
            ("archive-2", card(vec![skill("archive", &[])]), false),
            ("echo", card(vec![skill("echo", &[])]), true),
            ("vip-desk", card(vec![]), true),
        ]
    }

    fn views<'a>(fleet: &'a [(&'static str, AgentCard, bool)]) -> Vec<AgentView<'a>> {
        fleet
            .iter()
            .map(|(id, card, healthy)| AgentView {
                id,
                card,
                healthy: *healthy,
            })
            .collect()
    }

    fn as_struct(value: Value) -> Option<Struct> {
        match value {
            Value::Null => None,
            Value::Object(map) => Some(map.into()),
            other => panic!("metadata must be an object, not {other}"),
        }
    }

    /// A request: tenant, message parts, message metadata, request metadata.
    struct Request {
        tenant: Option<&'static str>,
        message: Message,
        metadata: Option<Struct>,
    }

    impl Request {
        fn new(texts: &[&str]) -> Self {
            Self {
                tenant: None,
                message: Message {
                    message_id: "m1".to_owned(),
                    parts: texts.iter().map(|t| Part::text(*t)).collect(),
                    ..Message::default()
                },
                metadata: None,
            }
        }

        fn tenant(mut self, tenant: &'static str) -> Self {
            self.tenant = Some(tenant);
            self
        }

        fn message_meta(mut self, metadata: Value) -> Self {
            self.message.metadata = as_struct(metadata);
            self
        }

        fn request_meta(mut self, metadata: Value) -> Self {
            self.metadata = as_struct(metadata);
            self
        }

        fn part(mut self, part: Part) -> Self {
            self.message.parts.push(part);
            self
        }

        fn input(&self) -> RouteInput<'_> {
            RouteInput {
                tenant: self.tenant,
                message: &self.message,
                metadata: self.metadata.as_ref(),
            }
        }
    }

    fn asks(skill: &str) -> Request {
        Request::new(&["hello"]).request_meta(json!({ "skill": skill }))
    }

    #[test]
    fn routes_table() {
        let fleet = fleet();
        let agents = views(&fleet);
        // (case, rules, request, seed, expected agent)
        let cases: Vec<(&str, &str, Request, u64, Option<&str>)> = vec![
            (
                "skill matcher, no target: the agent declaring it",
                "[[route]]\nwhen.skill = 'invoice'",
                asks("invoice"),
                7,
                Some("billing"),
            ),
            (
                "skill read from message metadata",
                "[[route]]\nwhen.skill = 'invoice'",
                Request::new(&["x"]).message_meta(json!({ "skill": "invoice" })),
                0,
                Some("billing"),
            ),
            (
                "request metadata skill wins over message metadata",
                "[[route]]\nwhen.skill = 'echo'\nto.agent = 'echo'\n\
                 [[route]]\nwhen.skill = 'invoice'\nto.agent = 'vip-desk'",
                Request::new(&["x"])
                    .request_meta(json!({ "skill": "echo" }))
                    .message_meta(json!({ "skill": "invoice" })),
                0,
                Some("echo"),
            ),
            (
                "skill ids ignore ASCII case",
                "[[route]]\nwhen.skill = 'INVOICE'",
                asks("Invoice"),
                0,
                Some("billing"),
            ),
            (
                "qualified skill id {agentId}/{skillId} names that agent",
                "[[route]]\nwhen.skill = 'billing-2/refund'",
                asks("billing-2/refund"),
                5,
                Some("billing-2"),
            ),
            (
                "skill matcher, request asks for another skill",
                "[[route]]\nwhen.skill = 'invoice'",
                asks("refund"),
                0,
                None,
            ),
            (
                "skill matcher, request names no skill",
                "[[route]]\nwhen.skill = 'invoice'",
                Request::new(&["invoice please"]),
                0,
                None,
            ),
            (
                "tag matcher, no target: only agents declaring the skill with the tag",
                "[[route]]\nwhen.tag = 'legal'",
                asks("summarize"),
                0,
                Some("legal"),
            ),
            (
                "tag matcher with an agent target",
                "[[route]]\nwhen.tag = 'money'\nto.agent = 'vip-desk'",
                asks("refund"),
                0,
                Some("vip-desk"),
            ),
            (
                "tag matcher, requested skill lacks the tag",
                "[[route]]\nwhen.tag = 'legal'\nto.agent = 'vip-desk'",
                asks("invoice"),
                0,
                None,
            ),
            (
                "tenant matcher",
                "[[route]]\nwhen.tenant = 'acme'\nto.agent = 'echo'",
                Request::new(&["x"]).tenant("acme"),
                0,
                Some("echo"),
            ),
            (
                "tenant matcher, other tenant",
                "[[route]]\nwhen.tenant = 'acme'\nto.agent = 'echo'",
                Request::new(&["x"]).tenant("globex"),
                0,
                None,
            ),
            (
                "metadata dotted path into nested message metadata",
                "[[route]]\nwhen.metadata = { 'customer.tier' = 'gold' }\nto.agent = 'vip-desk'",
                Request::new(&["x"]).message_meta(json!({ "customer": { "tier": "gold" } })),
                0,
                Some("vip-desk"),
            ),
            (
                "metadata as a nested TOML table, found in request metadata",
                "[[route]]\nto.agent = 'vip-desk'\n[route.when.metadata.customer]\ntier = 'gold'",
                Request::new(&["x"]).request_meta(json!({ "customer": { "tier": "gold" } })),
                0,
                Some("vip-desk"),
            ),
            (
                "metadata key that itself contains dots",
                "[[route]]\nwhen.metadata = { 'example.com/v1.tier' = 'gold' }\nto.agent = 'vip-desk'",
                Request::new(&["x"]).message_meta(json!({ "example.com/v1": { "tier": "gold" } })),
                0,
                Some("vip-desk"),
            ),
            (
                "metadata number: 2 equals 2.0, any-of list",
                "[[route]]\nwhen.metadata = { priority = 2, region = ['eu', 'uk'] }\nto.agent = 'vip-desk'",
                Request::new(&["x"]).message_meta(json!({ "priority": 2.0, "region": "uk" })),
                0,
                Some("vip-desk"),
            ),
            (
                "metadata list in the request matches any item",
                "[[route]]\nwhen.metadata = { labels = 'urgent' }\nto.agent = 'vip-desk'",
                Request::new(&["x"]).message_meta(json!({ "labels": ["new", "urgent"] })),
                0,
                Some("vip-desk"),
            ),
            (
                "metadata mismatch (value, and string vs bool)",
                "[[route]]\nwhen.metadata = { 'customer.tier' = 'gold', vip = true }\nto.agent = 'vip-desk'",
                Request::new(&["x"])
                    .message_meta(json!({ "customer": { "tier": "gold" }, "vip": "true" })),
                0,
                None,
            ),
            (
                "text regex matches within the second text part",
                "[[route]]\nwhen.text = '(?i)\\binvoice\\b'\nto.agent = 'billing'",
                Request::new(&["hello", "About my INVOICE #12"]),
                0,
                Some("billing"),
            ),
            (
                "text regex ignores data parts",
                "[[route]]\nwhen.text = 'invoice'\nto.agent = 'billing'",
                Request::new(&["hello"]).part(Part::data(json!({ "note": "invoice" }))),
                0,
                None,
            ),
            (
                "rule order: the first matching rule wins",
                "[[route]]\nwhen.text = 'refund'\nto.agent = 'echo'\n\
                 [[route]]\nwhen.skill = 'refund'\nto.agent = 'vip-desk'",
                asks("refund").part(Part::text("refund please")),
                0,
                Some("echo"),
            ),
            (
                "rule order: a later rule when the first does not match",
                "[[route]]\nwhen.tenant = 'acme'\nto.agent = 'echo'\n\
                 [[route]]\nwhen.skill = 'refund'\nto.agent = 'vip-desk'",
                asks("refund"),
                0,
                Some("vip-desk"),
            ),
            (
                "all matchers of a rule must hold",
                "[[route]]\nwhen = { tenant = 'acme', text = 'refund' }\nto.agent = 'echo'",
                Request::new(&["an invoice"]).tenant("acme"),
                0,
                None,
            ),
            (
                "agent target not registered: rule skipped, next one applies",
                "[[route]]\nwhen.text = 'hello'\nto.agent = 'gone'\n\
                 [[route]]\nwhen.text = 'hello'\nto.agent = 'echo'",
                Request::new(&["hello"]),
                0,
                Some("echo"),
            ),
            (
                "skill target nobody declares: rule skipped",
                "[[route]]\nwhen.text = 'hello'\nto.skill = 'teleport'",
                Request::new(&["hello"]),
                0,
                None,
            ),
            (
                "pinned agent target is used even when unhealthy",
                "[[route]]\nwhen.text = 'old'\nto.agent = 'archive-2'",
                Request::new(&["old stuff"]),
                0,
                Some("archive-2"),
            ),
            (
                "no rules: None (the caller uses the default agent)",
                "",
                asks("refund"),
                0,
                None,
            ),
        ];
        assert!(cases.len() >= 15);
        for (case, toml_text, request, seed, expected) in cases {
            let got = rules(toml_text).route(&request.input(), &agents, seed);
            assert_eq!(got.as_deref(), expected, "case: {case}");
        }
    }

    #[test]
    fn skill_target_balances_round_robin_over_healthy_agents() {
        let fleet = fleet();
        let agents = views(&fleet);
        let rules = rules("[[route]]\nwhen.text = 'money'\nto.skill = 'refund'");
        let request = Request::new(&["money back"]);
        let picks: Vec<String> = (0..6)
            .map(|seed| rules.route(&request.input(), &agents, seed).unwrap())
            .collect();
        assert_eq!(
            picks,
            [
                "billing",
                "billing-2",
                "billing-3",
                "billing",
                "billing-2",
                "billing-3"
            ]
        );
        // Deterministic: the order of the agents slice does not matter.
        let reversed: Vec<AgentView<'_>> = agents.iter().rev().copied().collect();
        assert_eq!(
            rules.route(&request.input(), &reversed, 1).as_deref(),
            Some("billing-2")
        );
    }

    #[test]
    fn unhealthy_agents_are_skipped_while_one_is_healthy() {
        let mut fleet = fleet();
        for agent in fleet
            .iter_mut()
            .filter(|a| a.0 == "billing" || a.0 == "billing-3")
        {
            agent.2 = false;
        }
        let agents = views(&fleet);
        let rules = rules("[[route]]\nwhen.skill = 'refund'");
        let request = asks("refund");
        for seed in 0..5 {
            assert_eq!(
                rules.route(&request.input(), &agents, seed).as_deref(),
                Some("billing-2"),
                "seed {seed}"
            );
        }
    }

    #[test]
    fn all_unhealthy_still_routes_balanced() {
        let fleet = fleet();
        let agents = views(&fleet);
        let rules = rules("[[route]]\nwhen.skill = 'archive'");
        let request = asks("archive");
        let picks: Vec<Option<String>> = (0..2)
            .map(|seed| rules.route(&request.input(), &agents, seed))
            .collect();
        assert_eq!(
            picks,
            [Some("archive-1".to_owned()), Some("archive-2".to_owned())]
        );
    }

    #[test]
    fn decide_reports_rule_and_skill() {
        let fleet = fleet();
        let agents = views(&fleet);
        let rules = rules(
            "[[route]]\nwhen.tenant = 'acme'\nto.agent = 'echo'\n\
             [[route]]\nwhen.text = 'refund'\nto.skill = 'refund'",
        );
        let by_skill = Request::new(&["refund"]);
        assert_eq!(
            rules.decide(&by_skill.input(), &agents, 2),
            Some(Routed {
                agent: "billing-3".to_owned(),
                skill: Some("refund".to_owned()),
                rule: 1,
            })
        );
        let pinned = Request::new(&["refund"]).tenant("acme");
        assert_eq!(
            rules.decide(&pinned.input(), &agents, 2),
            Some(Routed {
                agent: "echo".to_owned(),
                skill: None,
                rule: 0,
            })
        );
    }

    #[test]
    fn agents_with_skill_lists_the_balancing_pool() {
        let mut fleet = fleet();
        fleet.iter_mut().find(|a| a.0 == "billing-2").unwrap().2 = false;
        let agents = views(&fleet);
        assert_eq!(
            agents_with_skill("refund", &agents),
            ["billing", "billing-3"]
        );
        assert_eq!(
            agents_with_skill("archive", &agents),
            ["archive-1", "archive-2"]
        );
        assert_eq!(agents_with_skill("legal/summarize", &agents), ["legal"]);
        assert!(agents_with_skill("teleport", &agents).is_empty());
    }

    #[test]
    fn requested_skill_sources() {
        let blank = Request::new(&["x"])
            .request_meta(json!({ "skill": "  " }))
            .message_meta(json!({ "skill": " refund " }));
        assert_eq!(requested_skill(&blank.input()), Some("refund"));
        let not_string = Request::new(&["x"]).request_meta(json!({ "skill": 3 }));
        assert_eq!(requested_skill(&not_string.input()), None);
    }

    #[test]
    fn compile_reports_every_error_at_once() {
        let raw = parse(
            "[[route]]\nwhen.text = '(unclosed'\nto.agent = 'a'\n\
             [[route]]\nto.agent = 'a'\n\
             [[route]]\nwhen.skill = 'refund'\nto = { agent = 'a', skill = 'refund' }\n\
             [[route]]\nwhen.tenant = 'acme'\n\
             [[route]]\nwhen.metadata = {}\nto.skill = ' '\n\
             [[route]]\nwhen.skill = 'fine'",
        );
        let errors = RoutingRules::compile(&raw).unwrap_err();
        let expected = [
            "route[0]: when.text: invalid regex \"(unclosed\": unclosed group",
            "route[1]: when: needs at least one of skill, tag, tenant, metadata, text",
            "route[2]: to: set agent or skill, not both",
            "route[3]: to: needs agent or skill (only a rule matching a skill or tag may omit it)",
            "route[4]: when.metadata: must not be empty",
            "route[4]: to.skill: must not be empty",
        ];
        assert_eq!(errors, expected);
    }

    #[test]
    fn compile_checks_metadata_values() {
        let raw = parse(
            "[[route]]\nto.agent = 'a'\n\
             when.metadata = { a = [], b = [{ c = 1 }], 'x..y' = 1, ok = [1, 'one'] }",
        );
        let errors = RoutingRules::compile(&raw).unwrap_err();
        assert_eq!(
            errors,
            [
                "route[0]: when.metadata.a: the list of values is empty",
                "route[0]: when.metadata.b: must be a string, number or boolean, or a list of them",
                "route[0]: when.metadata: \"x..y\" is not a dotted path",
            ]
        );
    }

    #[test]
    fn the_documented_example_deserializes_and_compiles() {
        let raw = parse(
            r#"
[[route]]
when.skill = "refund"

[[route]]
when.tag = "legal"

[[route]]
when.tenant = "acme"
to.agent = "acme-support"

[[route]]
when.metadata = { "customer.tier" = "gold", region = ["eu", "uk"] }
to.agent = "vip-desk"

[[route]]
when.text = '(?i)\b(invoice|refund)\b'
to.skill = "billing"
"#,
        );
        assert_eq!(raw.len(), 5);
        assert_eq!(
            raw[3].to,
            Target {
                agent: Some("vip-desk".to_owned()),
                skill: None,
            }
        );
        assert_eq!(
            raw[3].when.metadata.as_ref().unwrap()["region"],
            json!(["eu", "uk"])
        );
        let compiled = RoutingRules::compile(&raw).unwrap();
        assert_eq!(compiled.len(), 5);
        assert!(!compiled.is_empty());
    }

    #[test]
    fn unknown_keys_are_rejected() {
        for bad in [
            "[[route]]\nwhen.skil = 'x'",
            "[[route]]\nwhen.skill = 'x'\nto.agents = 'a'",
            "[[route]]\nwhen.skill = 'x'\nthen = 'a'",
        ] {
            assert!(toml::from_str::<File>(bad).is_err(), "accepted: {bad}");
        }
    }
}
