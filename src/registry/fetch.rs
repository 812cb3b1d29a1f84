//! Fetching AgentCards by URL for registration and health checks: behind
//! the outbound guard, with a timeout and a size cap.

use crate::netguard::OutboundPolicy;
use std::time::{Duration, Instant};

/// The well-known path of an agent's card.
pub const WELL_KNOWN_CARD: &str = "/.well-known/agent-card.json";

/// Why a card could not be fetched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FetchError {
    /// Not an absolute http(s) URL.
    #[error("{0}")]
    BadUrl(String),
    /// Refused by the outbound guard, before any connection.
    #[error("{0}")]
    Refused(String),
    /// No connection, or no answer in time.
    #[error("cannot reach {url}: {reason}")]
    Unreachable {
        /// The URL tried.
        url: String,
        /// What went wrong.
        reason: String,
    },
    /// The server answered with an error status.
    #[error("{url} answered HTTP {status}")]
    Status {
        /// The URL tried.
        url: String,
        /// The HTTP status.
        status: u16,
    },
    /// The card is larger than the cap.
    #[error("the card at {url} is larger than {limit} bytes")]
    TooLarge {
        /// The URL tried.
        url: String,
        /// The cap.
        limit: usize,
    },
    /// The body is not JSON.
    #[error("the card at {url} is not JSON: {reason}")]
    NotJson {
        /// The URL tried.
        url: String,
        /// The parse error.
        reason: String,
    },
}

/// A fetched card.
#[derive(Debug, Clone)]
pub struct FetchedCard {
    /// The card JSON, not yet validated.
    pub json: serde_json::Value,
    /// Where it was found.
    pub url: reqwest::Url,
    /// How long the fetch took.
    pub latency: Duration,
}

/// Fetches cards over HTTP under the outbound policy.
#[derive(Clone)]
pub struct CardFetcher {
    client: reqwest::Client,
    policy: OutboundPolicy,
    max_bytes: usize,
}

impl CardFetcher {
    /// A fetcher with a per-request `timeout` and a body cap of `max_bytes`.
    pub fn new(policy: OutboundPolicy, timeout: Duration, max_bytes: usize) -> Self {
        Self {
            client: policy.client(timeout),
            policy,
            max_bytes,
        }
    }

    /// The most bytes a card may have: fetched, or given inline.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// The card URL for what a caller gave: a URL with a path is used as it
    /// is; a bare origin gets the well-known path.
    pub fn card_location(given: &str) -> Result<reqwest::Url, FetchError> {
        let mut url = reqwest::Url::parse(given.trim())
            .map_err(|e| FetchError::BadUrl(format!("{given:?} is not a URL: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
            return Err(FetchError::BadUrl(format!(
                "{given:?} must be an absolute http or https URL"
            )));
        }
        if url.path() == "/" || url.path().is_empty() {
            url.set_path(WELL_KNOWN_CARD);
        }
        Ok(url)
    }

    /// Fetches and parses the card at `given`.
    pub async fn fetch(&self, given: &str) -> Result<FetchedCard, FetchError> {
        let url = Self::card_location(given)?;
        self.policy.check_url(&url).map_err(FetchError::Refused)?;
        let started = Instant::now();
        // What errors say of the URL: a health error is shown to every
        // agency, and a signed URL's query is its secret.
        let shown = crate::netguard::shown_url(&url);
        let unreachable = |err: reqwest::Error| {
            // The whole chain: the cause (refused, a certificate not
            // trusted) is often several errors down.
            let reason = crate::upstream::error_chain(&err.without_url());
            // The guard refuses in the resolver; say so plainly.
            if reason.contains("--allow-upstream") {
                FetchError::Refused(reason)
            } else {
                FetchError::Unreachable {
                    url: shown.clone(),
                    reason,
                }
            }
        };
        let mut response = self
            .client
            .get(url.clone())
            .header(reqwest::header::ACCEPT, "application/json")
            .send()
            .await
            .map_err(unreachable)?;
        if !response.status().is_success() {
            return Err(FetchError::Status {
                url: shown.clone(),
                status: response.status().as_u16(),
            });
        }
        let too_large = || FetchError::TooLarge {
            url: shown.clone(),
            limit: self.max_bytes,
        };
        if response
            .content_length()
            .is_some_and(|len| len > self.max_bytes as u64)
        {
            return Err(too_large());
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(unreachable)? {
            if body.len() + chunk.len() > self.max_bytes {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        let json = serde_json::from_slice(&body).map_err(|e| FetchError::NotJson {
            url: shown.clone(),
            reason: e.to_string(),
        })?;
        Ok(FetchedCard {
            json,
            url,
            latency: started.elapsed(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_origins_get_the_well_known_path() {
        let url = CardFetcher::card_location("http://agent.example:9000").unwrap();
        assert_eq!(
            url.as_str(),
            "http://agent.example:9000/.well-known/agent-card.json"
        );
        let url = CardFetcher::card_location("https://a.example/cards/x.json").unwrap();
        assert_eq!(url.path(), "/cards/x.json");
        assert!(CardFetcher::card_location("ftp://a.example/").is_err());
        assert!(CardFetcher::card_location("not a url").is_err());
    }

    #[tokio::test]
    async fn internal_literals_are_refused_before_connecting() {
        let fetcher = CardFetcher::new(OutboundPolicy::default(), Duration::from_secs(1), 1024);
        for url in [
            "http://10.0.0.1/",
            "http://169.254.169.254/latest",
            "http://127.0.0.1:9/",
        ] {
            assert!(
                matches!(fetcher.fetch(url).await, Err(FetchError::Refused(_))),
                "{url}"
            );
        }
    }
}
