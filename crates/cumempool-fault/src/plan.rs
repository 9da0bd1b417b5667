//! The fault plan: which calls of which entry points fail, and with what `CUresult`.
//!
//! Text form, rules separated by `;`, fields by `:`:
//! `cuMemAllocFromPoolAsync:nth=3:code=2;cuMemFreeAsync:every=2:code=700;cuStreamSynchronize:p=0.25:seed=7:code=999`.
//! Each rule counts the calls of its function from the moment the plan was set: `nth=N` fails
//! the Nth call only, `every=N` every Nth call (the Nth, 2Nth, ...), `p=P:seed=S` each call with
//! probability P, drawn from a generator seeded with S (so a run can be repeated). `code` is the
//! `CUresult` returned instead of calling the driver (default 999, `CUDA_ERROR_UNKNOWN`).

use std::fmt;

/// Functions the plan may not name: the error path itself resolves and calls them, and a fault
/// there would turn every injected failure into a different one.
pub(crate) const NEVER_FAILED: &[&str] = &["cuGetErrorName", "cuGetErrorString", "cuGetProcAddress"];

/// `CUDA_ERROR_UNKNOWN`: the code injected when a rule names none.
const DEFAULT_CODE: u32 = 999;

/// Which of a function's calls a rule fails.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum When {
    /// Only the Nth call (from 1).
    Nth(u64),
    /// Every Nth call.
    Every(u64),
    /// Each call with this probability, drawn from a xorshift generator with this state.
    Chance { probability: f64, state: u64 },
}

/// One rule: a function, which of its calls fail, and the code they answer.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Rule {
    /// Index of the function in the bindings' entry-point list.
    pub(crate) entry: usize,
    pub(crate) when: When,
    pub(crate) code: u32,
    /// Calls of the function seen since the plan was set.
    seen: u64,
}

impl Rule {
    /// Counts one call and says whether it fails.
    fn fails_next(&mut self) -> bool {
        self.seen += 1;
        match &mut self.when {
            When::Nth(n) => self.seen == *n,
            When::Every(n) => self.seen.is_multiple_of(*n),
            When::Chance { probability, state } => {
                // xorshift64*: small, seedable, and the same on every platform.
                *state ^= *state >> 12;
                *state ^= *state << 25;
                *state ^= *state >> 27;
                let draw = state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11;
                (draw as f64 / (1u64 << 53) as f64) < *probability
            }
        }
    }
}

/// A plan the text did not describe, with what was wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PlanError(pub(crate) String);

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The rules in force.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Plan {
    rules: Vec<Rule>,
}

impl Plan {
    /// No rules: every call reaches the driver.
    pub(crate) const EMPTY: Plan = Plan { rules: Vec::new() };

    /// Parses the text form; `index_of` maps a function name to its entry index.
    pub(crate) fn parse(text: &str, index_of: impl Fn(&str) -> Option<usize>) -> Result<Self, PlanError> {
        let mut rules = Vec::new();
        for rule in text.split(';').map(str::trim).filter(|r| !r.is_empty()) {
            rules.push(parse_rule(rule, &index_of)?);
        }
        Ok(Self { rules })
    }

    /// Whether any rule is in force (the wrappers skip the lock when none is).
    pub(crate) fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Counts a call of `entry` with every rule for it and answers the code to inject, if any.
    pub(crate) fn decide(&mut self, entry: usize) -> Option<u32> {
        let mut injected = None;
        for rule in self.rules.iter_mut().filter(|r| r.entry == entry) {
            if rule.fails_next() && injected.is_none() {
                injected = Some(rule.code);
            }
        }
        injected
    }
}

fn parse_rule(rule: &str, index_of: &impl Fn(&str) -> Option<usize>) -> Result<Rule, PlanError> {
    let mut fields = rule.split(':').map(str::trim);
    let function = fields.next().unwrap_or_default();
    if NEVER_FAILED.contains(&function) {
        return Err(PlanError(format!(
            "{function} cannot be failed: the error path (and the resolution of every other entry point) uses it"
        )));
    }
    let entry = index_of(function)
        .ok_or_else(|| PlanError(format!("`{function}` in `{rule}` is not an entry point of the bindings")))?;
    let (mut nth, mut every, mut probability, mut seed, mut code) = (None, None, None, None, DEFAULT_CODE);
    for field in fields {
        let (key, value) =
            field.split_once('=').ok_or_else(|| PlanError(format!("`{field}` in `{rule}` is not key=value")))?;
        let number = |what: &str| -> Result<u64, PlanError> {
            value
                .parse::<u64>()
                .map_err(|_| PlanError(format!("{what} must be a whole number, not `{value}` in `{rule}`")))
        };
        match key {
            "nth" => nth = Some(number("nth")?),
            "every" => every = Some(number("every")?),
            "seed" => seed = Some(number("seed")?),
            "code" => {
                code = u32::try_from(number("code")?)
                    .map_err(|_| PlanError(format!("code `{value}` in `{rule}` is not a CUresult")))?
            }
            "p" => {
                probability = Some(value.parse::<f64>().ok().filter(|p| (0.0..=1.0).contains(p)).ok_or_else(|| {
                    PlanError(format!("p must be a probability between 0 and 1, not `{value}` in `{rule}`"))
                })?)
            }
            _ => return Err(PlanError(format!("unknown key `{key}` in `{rule}` (nth, every, p, seed, code)"))),
        }
    }
    if code == 0 {
        return Err(PlanError(format!("code 0 is CUDA_SUCCESS, not a failure, in `{rule}`")));
    }
    let when = match (nth, every, probability) {
        (Some(n), None, None) if n > 0 => When::Nth(n),
        (None, Some(n), None) if n > 0 => When::Every(n),
        (None, None, Some(probability)) => {
            // A zero state would stay zero; any other seed gives a full-period sequence.
            When::Chance { probability, state: seed.unwrap_or(1).max(1) }
        }
        _ => {
            return Err(PlanError(format!(
                "`{rule}` needs exactly one of nth=N or every=N (N from 1) or p=P (with an optional seed)"
            )))
        }
    };
    if seed.is_some() && !matches!(when, When::Chance { .. }) {
        return Err(PlanError(format!("seed is for p=P rules, in `{rule}`")));
    }
    Ok(Rule { entry, when, code, seen: 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index_of(name: &str) -> Option<usize> {
        ["cuMemAllocFromPoolAsync", "cuMemFreeAsync", "cuStreamSynchronize"].iter().position(|n| *n == name)
    }

    fn answers(plan: &mut Plan, entry: usize, calls: usize) -> Vec<Option<u32>> {
        (0..calls).map(|_| plan.decide(entry)).collect()
    }

    #[test]
    fn the_three_kinds_of_rule_fail_the_calls_they_name() {
        let text =
            "cuMemAllocFromPoolAsync:nth=3:code=2; cuMemFreeAsync:every=2:code=700;cuStreamSynchronize:p=0.25:seed=7";
        let mut plan = Plan::parse(text, index_of).unwrap();
        assert_eq!(answers(&mut plan, 0, 4), [None, None, Some(2), None]);
        assert_eq!(answers(&mut plan, 1, 4), [None, Some(700), None, Some(700)]);
        let drawn = answers(&mut plan, 2, 4000);
        let failed = drawn.iter().filter(|a| **a == Some(999)).count();
        assert!((800..1200).contains(&failed), "{failed} of 4000 at p=0.25");
        let mut again = Plan::parse(text, index_of).unwrap();
        assert_eq!(answers(&mut again, 2, 4000), drawn, "the same seed fails the same calls");
    }

    #[test]
    fn mistakes_are_reported_with_what_is_wrong() {
        let error = |text: &str| Plan::parse(text, index_of).unwrap_err().0;
        assert!(error("cuMemAlloc:nth=1").contains("not an entry point"));
        assert!(error("cuGetErrorName:nth=1").contains("cannot be failed"));
        assert!(error("cuMemFreeAsync:nth=0").contains("exactly one of"));
        assert!(error("cuMemFreeAsync:nth=1:every=2").contains("exactly one of"));
        assert!(error("cuMemFreeAsync:nth=x").contains("whole number"));
        assert!(error("cuMemFreeAsync:p=2").contains("probability"));
        assert!(error("cuMemFreeAsync:nth=1:code=0").contains("CUDA_SUCCESS"));
        assert!(error("cuMemFreeAsync:nth=1:when=3").contains("unknown key"));
        assert!(error("cuMemFreeAsync:nth=1:seed=3").contains("seed"));
        assert!(Plan::parse(" ; ", index_of).unwrap().is_empty());
    }
}
