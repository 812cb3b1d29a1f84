//! Where a task goes next (DESIGN.md §3.3): a transfer to the agent a
//! payload names, a result returned to the agent that handed off, and the
//! failure ladder when an agent does not acknowledge (retry, reroute by
//! skill, then escalate or fail).

use super::driver::{Driver, TransferOffer, Turn, status_update};
use crate::agents::{AgentRequest, UpstreamRef};
use crate::error::GatewayError;
use crate::handoff::context::{message_bytes, result_parts, transfer_parts};
use crate::handoff::control::Control;
use crate::handoff::payload::{
    HANDOFF_MEDIA_TYPE, HandoffTarget, PayloadValidator, find_data, violations_detail,
};
use crate::handoff::reasons::{self, status_part};
use crate::handoff::routing::{AgentView, agents_with_skill};
use crate::protocol::*;
use crate::registry::AgentEntry;
use crate::store::{HopKind, HopRecord, SchemaBinding, TaskRecord, TransferSource, Undelivered};
use chrono::Utc;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

/// Why a handoff may not go to its target: a reason code and its detail.
pub(super) type Refusal = (&'static str, Value);

impl super::Gateway {
    /// Agents declaring `skill`, other than those in `excluded`: the healthy
    /// ones, or all of them when none is healthy (one may still answer, and
    /// the failure ladder takes over if it does not).
    pub(super) fn agents_for_skill(
        &self,
        skill: &str,
        excluded: &[String],
    ) -> Vec<Arc<AgentEntry>> {
        let entries: Vec<Arc<AgentEntry>> = self
            .directory()
            .list()
            .into_iter()
            .filter(|e| !excluded.contains(&e.id))
            .collect();
        let views = agent_views(&entries);
        let chosen = agents_with_skill(skill, &views);
        entries
            .iter()
            .filter(|e| chosen.contains(&e.id.as_str()))
            .cloned()
            .collect()
    }

    /// One of `candidates`, taking turns between calls.
    pub(super) fn balanced(&self, candidates: &[Arc<AgentEntry>]) -> Option<Arc<AgentEntry>> {
        if candidates.is_empty() {
            return None;
        }
        let turn = self.next_balance() as usize % candidates.len();
        Some(candidates[turn].clone())
    }

    /// One of `candidates` that `control` lets `source` hand work to (not in
    /// the chain, allowing the source), taking turns; when none is, any of
    /// them, whose refusal then says why.
    pub(super) fn balanced_allowed(
        &self,
        candidates: &[Arc<AgentEntry>],
        control: &Control,
        source: Option<&str>,
    ) -> Option<Arc<AgentEntry>> {
        let allowed: Vec<Arc<AgentEntry>> = candidates
            .iter()
            .filter(|c| policy_refusal(control, &c.id, Some(c), source).is_none())
            .cloned()
            .collect();
        self.balanced(if allowed.is_empty() {
            candidates
        } else {
            &allowed
        })
    }
}

/// What the routing functions see of `entries`: ids, cards and health.
pub(super) fn agent_views(entries: &[Arc<AgentEntry>]) -> Vec<AgentView<'_>> {
    entries.iter().map(|e| agent_view(e)).collect()
}

/// What the routing functions see of one entry.
pub(super) fn agent_view(entry: &AgentEntry) -> AgentView<'_> {
    AgentView {
        id: &entry.id,
        card: entry.agent.card(),
        healthy: entry.is_healthy(),
    }
}

/// Why policy refuses to deliver a line of work to `target`, if it does:
/// the hop limit is reached, `target` already holds it (a cycle), or
/// `source` is not on the target's allow list.
pub(super) fn policy_refusal(
    control: &Control,
    target: &str,
    target_entry: Option<&AgentEntry>,
    source: Option<&str>,
) -> Option<Refusal> {
    let max_hops = target_entry
        .and_then(|e| e.policy.max_hops)
        .map_or(control.max_hops, |own| own.min(control.max_hops));
    if control.hops >= max_hops {
        return Some((
            reasons::HOP_LIMIT_EXCEEDED,
            json!({"hops": control.hops, "maxHops": max_hops, "chain": control.chain}),
        ));
    }
    if control.chain.iter().any(|held| held == target) {
        return Some((
            reasons::HANDOFF_CYCLE,
            json!({"target": target, "chain": control.chain}),
        ));
    }
    if let (Some(entry), Some(source)) = (target_entry, source)
        && !entry.policy.allows(source)
    {
        return Some((
            reasons::NOT_ALLOWED,
            json!({"source": source, "target": target}),
        ));
    }
    None
}

/// `max_hops` lowered to `agent`'s own hop limit, which binds the work from
/// the hop it takes up on, as it does when the agent is a send's first
/// choice (0 is no limit yet).
fn own_max_hops(max_hops: u32, agent: &AgentEntry) -> u32 {
    match agent.policy.max_hops {
        Some(own) if max_hops == 0 || own < max_hops => own,
        _ => max_hops,
    }
}

/// A deadline shortened by an agent's own task timeout.
pub(super) fn agent_deadline(
    deadline: Option<chrono::DateTime<Utc>>,
    agent: &AgentEntry,
) -> Option<chrono::DateTime<Utc>> {
    let own = agent
        .policy
        .task_timeout
        .and_then(|t| chrono::Duration::from_std(t).ok())
        .and_then(|t| Utc::now().checked_add_signed(t));
    match (deadline, own) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

impl Driver {
    /// Moves the task to the agent a payload names. `None` when the
    /// transfer is refused (the task is then REJECTED with the reason).
    pub(super) async fn transfer(&mut self, source: &Turn, offer: TransferOffer) -> Option<Turn> {
        let source_id = source.agent.id.clone();
        let payload = match PayloadValidator::shared().validate(&offer.data) {
            Ok(payload) => payload,
            Err(violations) => {
                let refusal = (reasons::SCHEMA_INVALID, violations_detail(&violations));
                self.refuse_handoff(refusal).await;
                return None;
            }
        };
        let record = self.gateway.ledger.get(&self.task_id).ok().flatten()?;
        let control = Control::read_from(record.task.metadata.as_ref()).unwrap_or_default();
        let (target, skill) = match &payload.target {
            HandoffTarget::Agent(to) => match self.gateway.agent(to) {
                Some(target) => (target, None),
                None => {
                    self.refuse_handoff((reasons::TARGET_NOT_FOUND, json!({"to": to})))
                        .await;
                    return None;
                }
            },
            HandoffTarget::Skill(skill) => {
                let candidates = self
                    .gateway
                    .agents_for_skill(skill, std::slice::from_ref(&source_id));
                let chosen = self
                    .gateway
                    .balanced_allowed(&candidates, &control, Some(&source_id));
                match chosen {
                    Some(target) => (target, Some(skill.clone())),
                    None => {
                        let detail = json!({"toSkill": skill});
                        self.refuse_handoff((reasons::TARGET_NOT_FOUND, detail))
                            .await;
                        return None;
                    }
                }
            }
        };
        if let Some(refusal) = policy_refusal(&control, &target.id, Some(&target), Some(&source_id))
        {
            self.refuse_handoff(refusal).await;
            return None;
        }
        let mut delivered = control.delivered_to(&target.id);
        delivered.handoff_id = Some(payload.handoff_id.clone());
        delivered.deadline = agent_deadline(delivered.deadline, &target);
        delivered.max_hops = own_max_hops(delivered.max_hops, &target);
        self.deadline = delivered.deadline;

        let parts = transfer_parts(&offer.data, &payload, &record.task.history);
        let mut message = Message::user(parts);
        message.task_id = self.task_id.clone();
        message.context_id = self.context_id.clone();
        delivered.write_into(&mut message.metadata);
        let bytes = message_bytes(&message);
        let (return_schema, return_schema_by_skill) =
            handoff_return_schema(payload.return_schema.as_ref(), &target, skill.as_deref());
        tracing::info!(task_id = %self.task_id, from = %source_id, to = %target.id, handoff_id = %payload.handoff_id, bytes, "transfer");

        let now = Utc::now();
        let (task_id, context_id) = (self.task_id.clone(), self.context_id.clone());
        // The source's own task, left open at the agent by a source that
        // hands on for good: nothing will resume it.
        let mut left_open = None;
        let moved = self
            .gateway
            .ledger
            .update(&task_id, |record| {
                if record.task.status.state.is_terminal() {
                    return Err(GatewayError::UnsupportedOperation(
                        "the task ended before the transfer".into(),
                    ));
                }
                let source_upstream = record.upstream.take();
                if !payload.return_to_parent && !offer.state.is_terminal() {
                    left_open.clone_from(&source_upstream);
                }
                if let Some(hop) = record.hops.last_mut() {
                    hop.ended_at = Some(now);
                    hop.state = Some(offer.state);
                }
                record.hops.push(HopRecord {
                    agent: target.id.clone(),
                    kind: HopKind::Transfer,
                    started_at: now,
                    message_bytes: Some(bytes),
                    attempts: 1,
                    undelivered: Some(Undelivered {
                        message: message.clone(),
                        skill: skill.clone(),
                        upstream: None,
                    }),
                    ..HopRecord::default()
                });
                // What binds the source's work binds its target's too when
                // the source hands on for good; a target that returns its
                // result starts without, and the source's come back with it.
                let mut handed_on = std::mem::take(&mut record.handed_on_schemas);
                let mut source_handed_on = Vec::new();
                // Where the source's own artifacts began, and where the
                // target's begin: the artifacts the task has now.
                let source_mark = record.schema_mark();
                let (source_from, source_digests) =
                    (source_mark.from, source_mark.digests.to_vec());
                let digests_now = crate::handoff::artifacts::digests(&record.task.artifacts);
                if payload.return_to_parent {
                    source_handed_on = std::mem::take(&mut handed_on);
                } else if let Some(schema) = &record.return_schema {
                    handed_on.push(SchemaBinding {
                        schema: schema.clone(),
                        from: source_from,
                        digests: source_digests.clone(),
                    });
                }
                let transfer = TransferSource {
                    agent: source_id.clone(),
                    upstream: source_upstream,
                    state: offer.state,
                    handoff_id: payload.handoff_id.clone(),
                    return_to_parent: payload.return_to_parent,
                    artifacts_before: record.task.artifacts.len(),
                    before_digests: digests_now.clone(),
                    waiting: Vec::new(),
                    return_schema: None,
                    source_schema: record.return_schema.clone(),
                    source_schema_from: source_from,
                    source_schema_digests: source_digests,
                    deadline_before: control.deadline,
                    max_hops_before: Some(control.max_hops),
                    source_handed_on,
                    released: false,
                };
                let earlier = record.transfer.take();
                record.transfer = Some(transfer.after(earlier, record.return_schema.take()));
                record.agent = target.id.clone();
                record.return_schema = return_schema;
                record.return_schema_by_skill = return_schema_by_skill;
                record.return_schema_from = Some(record.task.artifacts.len());
                record.return_schema_digests = digests_now;
                record.handed_on_schemas = handed_on;
                delivered.write_into(&mut record.task.metadata);
                // Still WORKING for the caller; the control shows the new holder.
                let mut metadata = None;
                delivered.write_into(&mut metadata);
                let StreamResponse::StatusUpdate(mut update) =
                    status_update(&task_id, &context_id, TaskState::Working, None)
                else {
                    unreachable!("status_update builds a status update");
                };
                update.metadata = metadata;
                Ok(vec![StreamResponse::StatusUpdate(update)])
            })
            .await;
        let record = match moved {
            Ok(record) => record,
            Err(err) => {
                self.fail_unrecorded("the transfer could not be recorded", err)
                    .await;
                return None;
            }
        };
        if let Some(upstream) = left_open {
            super::tell_canceled(source.agent.clone(), record.task.clone(), Some(upstream));
        }
        self.gateway.metrics_handoff(
            (&source_id, &target.id),
            HopKind::Transfer,
            delivered.hops,
            bytes,
        );
        Some(Turn {
            agent: target,
            request: AgentRequest {
                task_id: self.task_id.clone(),
                context_id: self.context_id.clone(),
                message,
                task: Some(Arc::unwrap_or_clone(record).task),
                upstream: None,
                streaming: source.request.streaming,
                accepted_output_modes: source.request.accepted_output_modes.clone(),
                cancel: self.task_cancel.child_token(),
            },
            handoff: true,
            skill,
            source: Some(source_id),
        })
    }

    /// Delivers a completed transfer's result to the agent that made it
    /// (`returnToParent`): on the source's own task when that waits for
    /// input, else as a new task in the source's context. `record` is the
    /// task as the target's completion left it (the write below checks it
    /// is still open and its source still waits).
    pub(super) async fn give_back(
        &mut self,
        target: &Turn,
        record: &TaskRecord,
        artifacts: Vec<Artifact>,
    ) -> Option<Turn> {
        let goes_to = record.transfer.as_ref().and_then(|t| t.result_goes_to());
        let Some(source) = goes_to.cloned() else {
            // Not a returning turn's record: nothing can happen here.
            self.fail_unrecorded(
                "the result had no source to go to",
                GatewayError::Internal("no transfer".into()),
            )
            .await;
            return None;
        };
        let Some(source_agent) = self.gateway.agent(&source.agent) else {
            let detail = json!({"to": source.agent});
            self.fail(vec![status_part(reasons::TARGET_NOT_FOUND, detail)])
                .await;
            return None;
        };
        let parts = result_parts(
            &source.handoff_id,
            &target.agent.id,
            TaskState::Completed,
            &artifacts,
        );
        // The return leg is the gateway's own: never a cycle, never refused.
        let control = Control::read_from(record.task.metadata.as_ref()).unwrap_or_default();
        let mut delivered = control.delivered_to(&source.agent);
        // The source's deadline, not its target's shorter one.
        if let Some(before) = source.deadline_before {
            delivered.deadline = Some(before);
            self.deadline = Some(before);
        }
        // And its hop limit, not its target's lower one.
        if let Some(before) = source.max_hops_before {
            delivered.max_hops = before;
        }
        let mut message = Message::user(parts);
        message.task_id = self.task_id.clone();
        message.context_id = self.context_id.clone();
        delivered.write_into(&mut message.metadata);
        let upstream = source.upstream.clone().map(|held| {
            if source.state.is_interrupted() {
                held
            } else {
                UpstreamRef {
                    task_id: String::new(),
                    context_id: held.context_id,
                }
            }
        });
        let now = Utc::now();
        let bytes = message_bytes(&message);
        let task_id = self.task_id.clone();
        let mut source_released = false;
        let returned = self
            .gateway
            .ledger
            .update(&task_id, |record| {
                if record.task.status.state.is_terminal() {
                    return Err(GatewayError::UnsupportedOperation(
                        "the task ended before the result returned".into(),
                    ));
                }
                // A cancel or deadline that released the source (and sent
                // its task a CancelTask) is ending the task: no resuming it.
                let goes_to = record.transfer.as_ref().and_then(|t| t.result_goes_to());
                if goes_to.is_none_or(|source| source.released) {
                    source_released = true;
                    return Err(GatewayError::UnsupportedOperation(
                        "the source was released before the result returned".into(),
                    ));
                }
                if let Some(hop) = record.hops.last_mut() {
                    hop.ended_at = Some(now);
                    hop.state = Some(TaskState::Completed);
                }
                record.hops.push(HopRecord {
                    agent: source.agent.clone(),
                    kind: HopKind::Return,
                    started_at: now,
                    message_bytes: Some(bytes),
                    attempts: 1,
                    undelivered: Some(Undelivered {
                        message: message.clone(),
                        skill: None,
                        upstream: upstream.clone(),
                    }),
                    ..HopRecord::default()
                });
                record.agent = source.agent.clone();
                record.upstream = upstream.clone().filter(|u| !u.task_id.is_empty());
                // An earlier source still waits for this one's result; the
                // source's work is bound again by the schema it was.
                record.transfer = record
                    .transfer
                    .as_ref()
                    .and_then(TransferSource::after_return);
                record.return_schema = source.source_schema.clone();
                // The source was not chosen by a skill for this work: a
                // reroute of the return keeps its schema.
                record.return_schema_by_skill = false;
                record.return_schema_from = Some(source.source_schema_from);
                record.return_schema_digests = source.source_schema_digests.clone();
                record.handed_on_schemas = source.source_handed_on.clone();
                delivered.write_into(&mut record.task.metadata);
                Ok(Vec::new())
            })
            .await;
        let returned = match returned {
            Ok(returned) => returned,
            Err(_) if source_released => {
                tracing::info!(task_id = %self.task_id, from = %target.agent.id, to = %source.agent, "result not returned: the source was released");
                self.end_after_release().await;
                return None;
            }
            Err(err) => {
                self.fail_unrecorded("the result could not be returned", err)
                    .await;
                return None;
            }
        };
        tracing::info!(task_id = %self.task_id, from = %target.agent.id, to = %source.agent, "handoff result returned");
        self.gateway.metrics_handoff(
            (&target.agent.id, &source.agent),
            HopKind::Return,
            delivered.hops,
            bytes,
        );
        Some(Turn {
            agent: source_agent,
            request: AgentRequest {
                task_id: self.task_id.clone(),
                context_id: self.context_id.clone(),
                message,
                task: Some(Arc::unwrap_or_clone(returned).task),
                upstream,
                streaming: target.request.streaming,
                accepted_output_modes: target.request.accepted_output_modes.clone(),
                cancel: self.task_cancel.child_token(),
            },
            handoff: true,
            skill: None,
            source: Some(target.agent.id.clone()),
        })
    }

    /// A returned result's source refused it into its own task, which it
    /// ended after it handed off: the result goes as a new task in that
    /// task's context, as it would have had the source ended its task
    /// before (DESIGN.md §3.3). The hop keeps the new address, for a
    /// restart's delivery.
    pub(super) async fn return_to_context(&mut self, mut turn: Turn) -> Option<Turn> {
        let held = turn.request.upstream.take()?;
        let in_context = UpstreamRef {
            task_id: String::new(),
            context_id: held.context_id,
        };
        let readdressed = self
            .gateway
            .ledger
            .update(&self.task_id, |record| {
                if record.task.status.state.is_terminal() {
                    return Err(GatewayError::UnsupportedOperation(
                        "the task ended before the result returned".into(),
                    ));
                }
                record.upstream = None;
                if let Some(undelivered) = record
                    .hops
                    .last_mut()
                    .and_then(|hop| hop.undelivered.as_mut())
                {
                    undelivered.upstream = Some(in_context.clone());
                }
                Ok::<_, GatewayError>(Vec::new())
            })
            .await;
        if let Err(err) = readdressed {
            self.fail_unrecorded("the result could not be returned", err)
                .await;
            return None;
        }
        tracing::info!(task_id = %self.task_id, to = %turn.agent.id, upstream_task_id = %held.task_id, "the source's own task ended; the result goes to its context");
        turn.request.upstream = Some(in_context);
        turn.request.cancel = self.task_cancel.child_token();
        Some(turn)
    }

    /// A handoff whose target had not acknowledged it when the gateway
    /// stopped: its delivery as first made (a direct handoff's message is
    /// the task's first, a transfer's or a returned result's is kept on its
    /// hop), with the skill the target was chosen by and the attempts made.
    /// After reroutes, the agents given up on are `tried` again, and the
    /// ladder goes on past a retry. `None` for any other task (a turn
    /// without a handoff, or one acknowledged).
    pub(super) fn undelivered_handoff(
        &mut self,
        agent: &Arc<AgentEntry>,
        record: &TaskRecord,
    ) -> Option<(Turn, u32)> {
        let last = record.hops.last()?;
        // A result goes back into the task its source left interrupted;
        // any other delivery starts a task at its agent.
        let unacknowledged = (record.upstream.is_none() || last.kind == HopKind::Return)
            && !record.task.status.state.is_settled()
            && last.acked_at.is_none()
            && last.agent == agent.id;
        if !unacknowledged {
            return None;
        }
        self.pending_delivery(agent, record)
    }

    /// An escalated handoff's delivery, tried again on the caller's `answer`
    /// (the ladder's end, DESIGN.md §3.3): the message it was delivering
    /// with the answer's parts after its own, under the answer's messageId,
    /// to the agent holding the task, on a new ladder.
    pub(super) fn redelivery(&mut self, record: &TaskRecord, answer: &Turn) -> Option<Turn> {
        // Its ladder begins at the reopened hop: nothing tried yet.
        let (mut turn, _) = self.pending_delivery(&answer.agent, record)?;
        let asked = &answer.request;
        turn.request.streaming = asked.streaming;
        turn.request
            .accepted_output_modes
            .clone_from(&asked.accepted_output_modes);
        tracing::info!(task_id = %self.task_id, agent = %answer.agent.id, "the caller answered an escalated handoff; delivering it again");
        Some(turn)
    }

    /// The delivery `record`'s last handoff was making, as first made, and
    /// the attempts made (see [`Self::undelivered_handoff`]).
    fn pending_delivery(
        &mut self,
        agent: &Arc<AgentEntry>,
        record: &TaskRecord,
    ) -> Option<(Turn, u32)> {
        let last = record.hops.last()?;
        let first = super::driver::delivery_began_at(&record.hops)?;
        let origin = &record.hops[first];
        let (mut message, skill, source, task, upstream) = match origin.kind {
            HopKind::Direct if first == 0 && record.transfer.is_none() => {
                let message = record.task.history.first()?.clone();
                let data = find_data(&message.parts, HANDOFF_MEDIA_TYPE)?;
                let payload = PayloadValidator::shared().validate(data).ok()?;
                let skill = match payload.target {
                    HandoffTarget::Skill(skill) => Some(skill),
                    HandoffTarget::Agent(_) => None,
                };
                (message, skill, Some(payload.from), None, None)
            }
            // A routed call names no sender.
            HopKind::Routed if first == 0 && record.transfer.is_none() => {
                let message = record.task.history.first()?.clone();
                (message, origin.skill.clone(), None, None, None)
            }
            kind @ (HopKind::Transfer | HopKind::Return) => {
                let Undelivered {
                    message,
                    skill,
                    upstream,
                } = origin.undelivered.clone()?;
                // A transfer comes from the task's source; a result from the
                // agent the hop before, whose work it carries.
                let source = match kind {
                    HopKind::Transfer => record.transfer.as_ref()?.agent.clone(),
                    _ => record.hops.get(first.checked_sub(1)?)?.agent.clone(),
                };
                (
                    message,
                    skill,
                    Some(source),
                    Some(record.task.clone()),
                    upstream,
                )
            }
            _ => return None,
        };
        // The caller's answers since the first escalation, none of which the
        // agent acknowledged.
        let answers =
            (origin.escalation_answers.iter()).filter_map(|&at| record.task.history.get(at));
        let mut answered = false;
        for answer in answers {
            message.parts.extend(answer.parts.iter().cloned());
            message.message_id.clone_from(&answer.message_id);
            answered = true;
        }
        // As first made, the message names its first target; the task's
        // control is the holder's, after any reroute.
        if answered && let Some(control) = Control::read_from(record.task.metadata.as_ref()) {
            control.write_into(&mut message.metadata);
        }
        // A redelivery's ladder began at the hop the answer reopened.
        let ladder_from = record.hops[first..]
            .iter()
            .rposition(|hop| !hop.escalation_answers.is_empty())
            .map_or(first, |at| first + at);
        let given_up = &record.hops[ladder_from..record.hops.len() - 1];
        self.tried = given_up.iter().map(|hop| hop.agent.clone()).collect();
        // A reroute's alternative gets one attempt, which the restart ended:
        // its message is only the next reroute's, whose control is rewritten.
        let attempts = if given_up.is_empty() {
            last.attempts.max(1)
        } else {
            2
        };
        let turn = Turn {
            agent: agent.clone(),
            request: AgentRequest {
                task,
                upstream,
                ..self.recovered_request(message)
            },
            handoff: true,
            skill,
            source,
        };
        Some((turn, attempts))
    }

    /// The failure ladder (DESIGN.md §3.3) after `turn`'s agent did not
    /// acknowledge: retry it once after the retry delay, then (chosen by
    /// skill) another healthy agent with the skill, then escalate or fail.
    pub(super) async fn next_attempt(
        &mut self,
        turn: Turn,
        why: String,
        attempts: &mut u32,
    ) -> Option<Turn> {
        let agent_id = turn.agent.id.clone();
        tracing::warn!(task_id = %self.task_id, agent = %agent_id, attempt = *attempts, %why, "no acknowledgement");
        if *attempts == 1 {
            *attempts = 2;
            let detail = json!({"agent": agent_id, "attempt": 2, "why": why});
            self.announce(reasons::RETRY, detail, None).await?;
            self.gateway.metrics.ladder_step(&agent_id, reasons::RETRY);
            let pause = tokio::time::sleep(self.gateway.settings.retry_delay);
            tokio::select! {
                _ = pause => {}
                _ = self.task_cancel.cancelled() => return None,
                // Checked below: the task fails at its deadline, not after the pause.
                () = super::driver::until(self.deadline) => {}
            }
            if self.deadline.is_some_and(|d| d <= Utc::now()) {
                self.expire(&turn.agent).await;
                return None;
            }
            let mut retry = turn;
            retry.request.cancel = self.task_cancel.child_token();
            return Some(retry);
        }
        self.tried.push(agent_id.clone());
        if let Some(skill) = turn.skill.clone() {
            let control = self.current_control();
            // The chain ends with the agent that failed; the others held the work before.
            let held: Vec<String> = control
                .chain
                .iter()
                .take(control.chain.len().saturating_sub(1))
                .cloned()
                .collect();
            // Nor the sender, as at the first choice: that would hand the
            // work back to where it came from.
            let excluded: Vec<String> = self
                .tried
                .iter()
                .chain(&held)
                .chain(turn.source.as_ref())
                .cloned()
                .collect();
            // An alternative is held to the policy the first choice met:
            // the control as it was before the failed delivery.
            let mut before = control.clone();
            before.chain = held;
            before.hops = before.hops.saturating_sub(1);
            // Only a healthy alternative (DESIGN.md §3.3): unlike a first
            // choice, a reroute has an agent to give up on already.
            let candidates: Vec<_> = self
                .gateway
                .agents_for_skill(&skill, &excluded)
                .into_iter()
                .filter(|alternative| alternative.is_healthy())
                .filter(|alternative| {
                    let source = turn.source.as_deref();
                    // With API keys, a sender named by the caller must also
                    // be the caller's own where the alternative guards it
                    // (checked last: it may read the ledger).
                    policy_refusal(&before, &alternative.id, Some(alternative), source).is_none()
                        && matches!(
                            self.gateway.claimed_source_refusal(
                                &self.owner,
                                source,
                                Some(alternative),
                                None,
                            ),
                            Ok(None)
                        )
                })
                .collect();
            if let Some(alternative) = self.gateway.balanced(&candidates) {
                let detail =
                    json!({"from": agent_id, "to": alternative.id, "toSkill": skill, "why": why});
                let mut rerouted = control.clone();
                if let Some(last) = rerouted.chain.last_mut() {
                    *last = alternative.id.clone();
                }
                rerouted.deadline = agent_deadline(rerouted.deadline, &alternative);
                // The alternative's own hop limit binds from here on, as it
                // would had it been the first choice.
                rerouted.max_hops = own_max_hops(rerouted.max_hops, &alternative);
                self.deadline = rerouted.deadline;
                let moved = Some((&alternative, &rerouted, skill.as_str()));
                self.announce(reasons::REROUTED, detail, moved).await?;
                self.gateway
                    .metrics
                    .ladder_step(&agent_id, reasons::REROUTED);
                // One attempt for each alternative: the ladder moves on after it.
                *attempts = 2;
                let mut request = turn.request;
                rerouted.write_into(&mut request.message.metadata);
                request.cancel = self.task_cancel.child_token();
                return Some(Turn {
                    agent: alternative,
                    request,
                    handoff: true,
                    skill: Some(skill),
                    source: turn.source,
                });
            }
        }
        let detail = json!({"tried": self.tried, "why": why});
        if self.gateway.settings.escalate {
            self.gateway
                .metrics
                .ladder_step(&agent_id, reasons::ESCALATED);
            self.settle(
                TaskState::InputRequired,
                vec![status_part(reasons::ESCALATED, detail)],
            )
            .await;
        } else {
            self.gateway
                .metrics
                .ladder_step(&agent_id, reasons::TARGET_UNAVAILABLE);
            self.fail(vec![status_part(reasons::TARGET_UNAVAILABLE, detail)])
                .await;
        }
        None
    }

    /// The task's control as the ledger holds it.
    fn current_control(&self) -> Control {
        self.gateway
            .ledger
            .get(&self.task_id)
            .ok()
            .flatten()
            .and_then(|record| Control::read_from(record.task.metadata.as_ref()))
            .unwrap_or_default()
    }

    /// Announces a ladder step as a status update in the task's current
    /// state; with `moved`, the task moves to that agent and control, chosen
    /// by that skill.
    /// `None` when the task ended meanwhile.
    async fn announce(
        &self,
        reason: &str,
        detail: Value,
        moved: Option<(&Arc<AgentEntry>, &Control, &str)>,
    ) -> Option<()> {
        let now = Utc::now();
        let (task_id, context_id) = (self.task_id.clone(), self.context_id.clone());
        self.gateway
            .ledger
            .update(&task_id, |record| {
                let state = record.task.status.state;
                if state.is_terminal() {
                    return Err(GatewayError::UnsupportedOperation("task ended".into()));
                }
                let mut message = Message::agent(vec![status_part(reason, detail)]);
                message.task_id = task_id.clone();
                message.context_id = context_id.clone();
                match moved {
                    Some((agent, control, skill)) => {
                        if let Some(hop) = record.hops.last_mut() {
                            hop.ended_at = Some(now);
                            hop.reason = Some(reason.to_string());
                        }
                        let bytes = record.hops.last().and_then(|h| h.message_bytes);
                        record.hops.push(HopRecord {
                            agent: agent.id.clone(),
                            kind: HopKind::Reroute,
                            started_at: now,
                            message_bytes: bytes,
                            attempts: 1,
                            ..HopRecord::default()
                        });
                        record.agent = agent.id.clone();
                        record.upstream = None;
                        // A result typed by the failed agent's skill is
                        // typed by the alternative's for the same skill.
                        if record.return_schema_by_skill {
                            record.return_schema = skill_output_schema(agent, Some(skill));
                        }
                        control.write_into(&mut record.task.metadata);
                    }
                    None => {
                        if let Some(hop) = record.hops.last_mut() {
                            hop.attempts += 1;
                            hop.reason = Some(reason.to_string());
                        }
                    }
                }
                Ok(vec![status_update(
                    &task_id,
                    &context_id,
                    state,
                    Some(message),
                )])
            })
            .await
            .ok()
            .map(|_| ())
    }

    /// What released the task's sources (a cancel or a deadline) ends the
    /// task within moments; should that write never come (it failed, or
    /// the process stopped in between), the task is canceled here rather
    /// than left WORKING with no agent on it.
    async fn end_after_release(&mut self) {
        let ended = |record: &TaskRecord| record.task.status.state.is_terminal();
        self.gateway
            .wait_for_record(&self.task_id, RELEASED_TASK_END_WAIT, ended)
            .await;
        let record = self.gateway.ledger.get_shared(&self.task_id);
        if !matches!(record, Ok(Some(record)) if ended(&record)) {
            let reason = "the sources waiting for the result were released";
            self.settle(TaskState::Canceled, vec![Part::text(reason)])
                .await;
        }
    }

    /// Fails the task when a handoff step could not be written to the ledger:
    /// no driver would be left to move it on.
    async fn fail_unrecorded(&mut self, what: &str, err: GatewayError) {
        tracing::debug!(task_id = %self.task_id, %err, what, "handoff step not applied");
        self.fail(vec![Part::text(format!("{what}: {err}"))]).await;
    }

    /// Refuses a handoff the task's agent asked for: the task is REJECTED
    /// with the reason, and nothing is delivered.
    async fn refuse_handoff(&mut self, (reason, detail): Refusal) {
        tracing::info!(task_id = %self.task_id, reason, "handoff refused");
        self.gateway.metrics.rejected(reason);
        self.settle(TaskState::Rejected, vec![status_part(reason, detail)])
            .await;
    }
}

/// How long a result's return leg, finding its source released, leaves the
/// task to what released it (a cancel's write follows at once, a
/// deadline's failure within `CANCEL_HEAD_START`) before it ends the task
/// itself.
const RELEASED_TASK_END_WAIT: Duration = Duration::from_secs(2);

/// The returnSchema a handoff's target is held to: the payload's (`named`),
/// else the output schema it declared for the skill it was chosen by; and
/// whether it is that skill's, which a reroute swaps for the alternative's.
pub(super) fn handoff_return_schema(
    named: Option<&serde_json::Map<String, Value>>,
    target: &AgentEntry,
    skill: Option<&str>,
) -> (Option<Value>, bool) {
    match named {
        Some(schema) => (Some(Value::Object(schema.clone())), false),
        None => (skill_output_schema(target, skill), skill.is_some()),
    }
}

/// The output schema an agency registered for the skill a target was
/// chosen by (`skillOutputSchemas`): that skill as the target's card
/// declares it, however the handoff spelled it (any case, or
/// `{agentId}/{skillId}`), so that no spelling that chose the agent skips
/// its schema.
pub(super) fn skill_output_schema(target: &AgentEntry, skill: Option<&str>) -> Option<Value> {
    let schemas = target.policy.skill_output_schemas.as_ref()?;
    let asked = skill?;
    let view = agent_view(target);
    let declared_id = |name: &str| {
        crate::handoff::routing::declared_skill(&view, name).map(|skill| skill.id.as_str())
    };
    // Keyed as registered, which may spell the skill as a handoff may.
    let declared = declared_id(asked);
    declared
        .and_then(|id| schemas.get(id))
        .or_else(|| schemas.get(asked))
        .or_else(|| {
            let declared = declared?;
            let keyed = schemas
                .iter()
                .find(|(key, _)| declared_id(key) == Some(declared));
            keyed.map(|(_, schema)| schema)
        })
        .cloned()
}
