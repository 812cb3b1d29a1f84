//! The results: one row per figure (measured, budget, verdict), printed as
//! a table and written as JSON with the machine they were taken on.

use crate::procfs::Machine;
use serde::Serialize;
use std::path::Path;

/// A budget from issue 5.
#[derive(Clone, Copy, Debug, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Budget {
    /// The figure must be at least this.
    Min(f64),
    /// The figure must be at most this.
    Max(f64),
}

impl Budget {
    fn holds(self, value: f64) -> bool {
        match self {
            Self::Min(min) => value >= min,
            Self::Max(max) => value <= max,
        }
    }

    fn show(self, unit: &str) -> String {
        let (sign, bound) = match self {
            Self::Min(bound) => ("≥", bound),
            Self::Max(bound) => ("≤", bound),
        };
        format!("{sign} {} {unit}", trim_number(bound))
            .trim_end()
            .to_string()
    }
}

/// PASS, FAIL or n/a (no budget, or not measured on purpose).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Verdict {
    /// Within budget.
    #[serde(rename = "PASS")]
    Pass,
    /// Over budget, or a budgeted figure could not be measured.
    #[serde(rename = "FAIL")]
    Fail,
    /// No budget.
    #[serde(rename = "n/a")]
    NotApplicable,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Pass => "PASS",
            Self::Fail => "FAIL",
            Self::NotApplicable => "n/a",
        })
    }
}

/// One row.
#[derive(Clone, Debug, Serialize)]
pub struct Figure {
    /// What was measured.
    pub figure: String,
    /// The number compared with the budget, in `unit`; absent when not measured.
    pub value: Option<f64>,
    /// Unit of `value` and of the budget.
    pub unit: String,
    /// The measurement as shown in the table.
    pub measured: String,
    /// The budget, if the issue gives one.
    pub budget: Option<Budget>,
    /// The verdict.
    pub verdict: Verdict,
    /// Context: what was approximated, what failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Figure {
    /// A measured figure without a budget; `measured` is how it is shown.
    pub fn info(
        figure: impl Into<String>,
        value: f64,
        unit: &str,
        measured: impl Into<String>,
    ) -> Self {
        Self {
            figure: figure.into(),
            value: Some(value),
            unit: unit.into(),
            measured: measured.into(),
            budget: None,
            verdict: Verdict::NotApplicable,
            note: None,
        }
    }

    /// A measured number in `unit`, shown as such.
    pub fn number(figure: impl Into<String>, value: f64, unit: &str) -> Self {
        let shown = format!("{} {unit}", trim_number(value))
            .trim_end()
            .to_string();
        Self::info(figure, value, unit, shown)
    }

    /// A measured number in `unit`, shown to `decimals` places but judged
    /// unrounded: a ratio of 0.2154 shows as 0.215 and misses a budget of
    /// 0.22, as 50.4 µs misses one of 50.
    pub fn exact(figure: impl Into<String>, value: f64, decimals: usize, unit: &str) -> Self {
        let shown = format!("{value:.decimals$} {unit}").trim_end().to_string();
        Self::info(figure, value, unit, shown)
    }

    /// A figure that was not measured, and why.
    pub fn unavailable(figure: impl Into<String>, unit: &str, why: impl Into<String>) -> Self {
        Self {
            figure: figure.into(),
            value: None,
            unit: unit.into(),
            measured: "not available".into(),
            budget: None,
            verdict: Verdict::NotApplicable,
            note: Some(why.into()),
        }
    }

    /// A figure whose measurement failed: FAIL if it has a budget.
    pub fn failed(
        figure: impl Into<String>,
        unit: &str,
        budget: Option<Budget>,
        err: &anyhow::Error,
    ) -> Self {
        Self {
            figure: figure.into(),
            value: None,
            unit: unit.into(),
            measured: "error".into(),
            budget,
            verdict: if budget.is_some() {
                Verdict::Fail
            } else {
                Verdict::NotApplicable
            },
            note: Some(format!("{err:#}")),
        }
    }

    /// The harness itself failed (e.g. Baton did not start): FAIL.
    pub fn harness_error(figure: impl Into<String>, err: &anyhow::Error) -> Self {
        Self {
            verdict: Verdict::Fail,
            ..Self::failed(figure, "", None, err)
        }
    }

    /// Judges the figure against `budget`.
    pub fn budget(mut self, budget: Budget) -> Self {
        self.budget = Some(budget);
        self.verdict = match self.value {
            Some(value) if budget.holds(value) => Verdict::Pass,
            _ => Verdict::Fail,
        };
        self
    }

    /// Adds a note.
    pub fn note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(note.into());
        self
    }

    fn budget_shown(&self) -> String {
        self.budget
            .map_or_else(|| "-".into(), |b| b.show(&self.unit))
    }
}

/// The whole run.
#[derive(Debug, Serialize)]
pub struct Report {
    /// `quick` or `full`.
    pub mode: &'static str,
    /// The machine.
    pub machine: Machine,
    /// Highest 1-minute load average seen between figures: other work on the machine.
    pub peak_load_average: f64,
    /// The share of the machine's time its host took over the run (`steal`
    /// in `/proc/stat`), if it could be read.
    pub stolen_share: Option<f64>,
    /// Seconds the run took.
    pub duration_secs: f64,
    /// The rows.
    pub figures: Vec<Figure>,
}

impl Report {
    /// The table: figure | measured | budget | verdict, notes below it.
    pub fn table(&self) -> String {
        let header = ["figure", "measured", "budget", "verdict"];
        let rows: Vec<[String; 4]> = self
            .figures
            .iter()
            .map(|f| {
                [
                    f.figure.clone(),
                    f.measured.clone(),
                    f.budget_shown(),
                    f.verdict.to_string(),
                ]
            })
            .collect();
        let mut widths = header.map(|h| h.chars().count());
        for row in &rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let line = |cells: [&str; 4]| {
            let padded: Vec<String> = cells
                .iter()
                .zip(widths)
                .map(|(cell, width)| format!("{cell}{}", " ".repeat(width - cell.chars().count())))
                .collect();
            format!("| {} |\n", padded.join(" | "))
        };
        let machine = &self.machine;
        let mut out = format!(
            "baton-bench ({}), {:.0} s on {} cores ({}), Linux {}; peak 1-minute load average {:.1}{}{}{}\n\n",
            self.mode,
            self.duration_secs,
            machine.nproc,
            machine.cpu_model,
            machine.kernel,
            self.peak_load_average,
            if self.peak_load_average > machine.nproc as f64 * 0.5 {
                ": other work shared the machine, so the figures are noisy"
            } else {
                ""
            },
            self.stolen_share.map_or(String::new(), |share| format!(
                "; the host took {:.1} % of the machine's time (steal)",
                share * 100.0
            )),
            machine.idle_clause("; "),
        );
        out.push_str(&line(header));
        out.push_str(&line(
            widths.map(|w| "-".repeat(w)).each_ref().map(String::as_str),
        ));
        for row in &rows {
            out.push_str(&line(row.each_ref().map(String::as_str)));
        }
        let notes: Vec<String> = self
            .figures
            .iter()
            .filter_map(|f| {
                f.note
                    .as_ref()
                    .map(|note| format!("- {}: {note}", f.figure))
            })
            .collect();
        if !notes.is_empty() {
            out.push_str("\nNotes:\n");
            out.push_str(&notes.join("\n"));
            out.push('\n');
        }
        out
    }

    /// Writes the report as JSON.
    pub fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        std::fs::write(path, serde_json::to_string_pretty(self)? + "\n")?;
        Ok(())
    }
}

/// `0.22`, `50000`, `1.5`: no trailing zeros.
fn trim_number(value: f64) -> String {
    let text = if value.abs() >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.3}")
    };
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_follow_budgets() {
        assert_eq!(
            Figure::number("x", 0.3, "")
                .budget(Budget::Min(0.22))
                .verdict,
            Verdict::Pass
        );
        assert_eq!(
            Figure::number("x", 60.0, "µs")
                .budget(Budget::Max(50.0))
                .verdict,
            Verdict::Fail
        );
        assert_eq!(Figure::number("x", 1.0, "").verdict, Verdict::NotApplicable);
    }

    #[test]
    fn a_figure_is_judged_on_its_value_not_as_shown() {
        let ratio = Figure::exact("x", 0.2154, 2, "").budget(Budget::Min(0.22));
        assert_eq!(
            (ratio.measured.as_str(), ratio.verdict),
            ("0.22", Verdict::Fail)
        );
        let cpu = Figure::exact("x", 50.04, 0, "µs").budget(Budget::Max(50.0));
        assert_eq!(
            (cpu.measured.as_str(), cpu.verdict),
            ("50 µs", Verdict::Fail)
        );
        let met = Figure::exact("x", 49.96, 1, "µs").budget(Budget::Max(50.0));
        assert_eq!(
            (met.measured.as_str(), met.verdict),
            ("50.0 µs", Verdict::Pass)
        );
    }

    #[test]
    fn numbers_are_trimmed() {
        assert_eq!(trim_number(0.22), "0.22");
        assert_eq!(trim_number(50_000.0), "50000");
        assert_eq!(trim_number(1.5), "1.5");
        assert_eq!(Budget::Max(1.5).show(""), "≤ 1.5");
    }
}
