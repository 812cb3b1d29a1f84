//! The task lifecycle: which state changes are allowed, and how an event
//! changes a task. This is the only place transition rules live; the ledger
//! applies every event through [`apply_event`].

use crate::protocol::{StreamResponse, Task, TaskArtifactUpdateEvent, TaskState};

/// Why an event could not be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    /// Terminal tasks are immutable.
    #[error("task is in terminal state {0:?} and cannot change")]
    Terminal(TaskState),
    /// A move the lifecycle does not allow.
    #[error("transition {from:?} -> {to:?} is not allowed")]
    NotAllowed {
        /// The current state.
        from: TaskState,
        /// The requested state.
        to: TaskState,
    },
    /// An event for a different task.
    #[error("event for task {0} applied to another task")]
    WrongTask(String),
    /// An answer to a question another answer took first: the agent works
    /// on that one, and a second would start another turn on one task.
    #[error(
        "the task took another answer to its question meanwhile and is {0:?}; \
         send more once it asks again"
    )]
    AnsweredMeanwhile(TaskState),
    /// A message for the agent that held the task, which was handed on
    /// meanwhile: it would reach an agent that no longer holds it.
    #[error("the task was handed on to agent {0:?} meanwhile; send the message again")]
    HandedOnMeanwhile(String),
}

/// Checks one state change.
///
/// SUBMITTED may go anywhere but back to UNSPECIFIED; WORKING and the
/// interrupted states may go to any non-SUBMITTED state; terminal states never
/// change. Re-announcing the current state is allowed (a new status message).
pub fn check_transition(from: TaskState, to: TaskState) -> Result<(), TransitionError> {
    use TaskState::*;
    if from.is_terminal() {
        return Err(TransitionError::Terminal(from));
    }
    let allowed = match (from, to) {
        (_, Unspecified) => false,
        (Unspecified, _) => true,
        (Submitted, _) => true,
        (Working | InputRequired | AuthRequired, Submitted) => false,
        (Working | InputRequired | AuthRequired, _) => true,
        (Completed | Failed | Canceled | Rejected, _) => false,
    };
    if allowed {
        Ok(())
    } else {
        Err(TransitionError::NotAllowed { from, to })
    }
}

/// Applies one event to a task, enforcing the transition rules.
///
/// A status message is appended to the history, so the history holds the
/// whole conversation. Artifact chunks with `append` extend the artifact with
/// the same id; otherwise an artifact replaces any earlier one with its id.
pub fn apply_event(task: &mut Task, event: &StreamResponse) -> Result<(), TransitionError> {
    match event {
        StreamResponse::Task(snapshot) => {
            if snapshot.id != task.id {
                return Err(TransitionError::WrongTask(snapshot.id.clone()));
            }
            if snapshot.status.state != task.status.state {
                check_transition(task.status.state, snapshot.status.state)?;
            } else if task.status.state.is_terminal() {
                return Err(TransitionError::Terminal(task.status.state));
            }
            *task = snapshot.clone();
        }
        StreamResponse::Message(message) => {
            if task.status.state.is_terminal() {
                return Err(TransitionError::Terminal(task.status.state));
            }
            task.history.push(message.clone());
        }
        StreamResponse::StatusUpdate(update) => {
            if update.task_id != task.id {
                return Err(TransitionError::WrongTask(update.task_id.clone()));
            }
            check_transition(task.status.state, update.status.state)?;
            if let Some(message) = &update.status.message {
                task.history.push(message.clone());
            }
            task.status = update.status.clone();
        }
        StreamResponse::ArtifactUpdate(update) => {
            if update.task_id != task.id {
                return Err(TransitionError::WrongTask(update.task_id.clone()));
            }
            if task.status.state.is_terminal() {
                return Err(TransitionError::Terminal(task.status.state));
            }
            merge_artifact(task, update);
        }
    }
    Ok(())
}

fn merge_artifact(task: &mut Task, update: &TaskArtifactUpdateEvent) {
    let incoming = &update.artifact;
    match task
        .artifacts
        .iter_mut()
        .find(|a| a.artifact_id == incoming.artifact_id)
    {
        Some(existing) if update.append => existing.parts.extend(incoming.parts.iter().cloned()),
        Some(existing) => *existing = incoming.clone(),
        None => task.artifacts.push(incoming.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Artifact, Part, TaskStatus, TaskStatusUpdateEvent};
    use TaskState::*;

    fn status(task: &Task, state: TaskState) -> StreamResponse {
        StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
            task_id: task.id.clone(),
            context_id: task.context_id.clone(),
            status: TaskStatus::now(state, None),
            metadata: None,
        })
    }

    #[test]
    fn transition_table() {
        let cases = [
            (Submitted, Working, true),
            (Submitted, Completed, true),
            (Submitted, Submitted, true),
            (Working, InputRequired, true),
            (InputRequired, Working, true),
            (AuthRequired, Completed, true),
            (Working, Submitted, false),
            (Working, Unspecified, false),
            (Completed, Working, false),
            (Failed, Failed, false),
            (Canceled, Completed, false),
            (Rejected, Working, false),
        ];
        for (from, to, ok) in cases {
            assert_eq!(check_transition(from, to).is_ok(), ok, "{from:?} -> {to:?}");
        }
    }

    #[test]
    fn terminal_tasks_are_immutable() {
        let mut task = Task {
            id: "t".into(),
            status: TaskStatus::now(Completed, None),
            ..Task::default()
        };
        let working = status(&task, Working);
        assert!(apply_event(&mut task, &working).is_err());
        let chunk = StreamResponse::ArtifactUpdate(TaskArtifactUpdateEvent {
            task_id: "t".into(),
            artifact: Artifact {
                artifact_id: "a".into(),
                parts: vec![Part::text("x")],
                ..Artifact::default()
            },
            ..TaskArtifactUpdateEvent::default()
        });
        assert!(apply_event(&mut task, &chunk).is_err());
    }

    #[test]
    fn artifact_chunks_append() {
        let mut task = Task {
            id: "t".into(),
            status: TaskStatus::now(Working, None),
            ..Task::default()
        };
        for (text, append) in [("a", false), ("b", true)] {
            let chunk = StreamResponse::ArtifactUpdate(TaskArtifactUpdateEvent {
                task_id: "t".into(),
                artifact: Artifact {
                    artifact_id: "x".into(),
                    parts: vec![Part::text(text)],
                    ..Artifact::default()
                },
                append,
                ..TaskArtifactUpdateEvent::default()
            });
            apply_event(&mut task, &chunk).unwrap();
        }
        assert_eq!(task.artifacts.len(), 1);
        assert_eq!(task.artifacts[0].parts.len(), 2);
    }
}
