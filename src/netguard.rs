//! The outbound-connection guard: Baton refuses to connect to loopback,
//! private, link-local and metadata addresses unless the operator allows them
//! (`--allow-upstream`). Checked after DNS resolution, in the HTTP client's
//! resolver, so a name cannot smuggle a private address past it.

use crate::tls::ClientTls;
use ipnet::IpNet;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

/// `url` without its `user:password@`: credentials go out in an
/// Authorization header, never in a request line, a message or a log.
pub fn without_credentials(url: &reqwest::Url) -> reqwest::Url {
    let mut bare = url.clone();
    // Only URLs that cannot be a base refuse these; http(s) ones never do.
    let _ = bare.set_username("");
    let _ = bare.set_password(None);
    bare
}

/// A URL as logs and replies show it: without credentials, query or
/// fragment, which may carry secrets (a signed URL's signature, say).
pub fn shown_url(url: &reqwest::Url) -> String {
    let mut shown = without_credentials(url);
    shown.set_query(None);
    shown.set_fragment(None);
    shown.to_string()
}

/// Which outbound addresses are allowed, and which TLS servers trusted.
#[derive(Clone, Debug, Default)]
pub struct OutboundPolicy {
    /// Networks allowed even though they are internal.
    pub allow: Vec<IpNet>,
    /// The roots `https` servers are verified against.
    pub tls: ClientTls,
}

impl OutboundPolicy {
    /// Whether Baton may connect to `ip`.
    pub fn permits(&self, ip: IpAddr) -> bool {
        if self.allow.iter().any(|net| net.contains(&ip)) {
            return true;
        }
        !is_internal(ip)
    }

    /// Checks a URL whose host is an IP literal (resolvers never see those).
    pub fn check_url(&self, url: &reqwest::Url) -> Result<(), String> {
        match url.host() {
            Some(url::Host::Ipv4(ip)) => self.check_ip(IpAddr::V4(ip)),
            Some(url::Host::Ipv6(ip)) => self.check_ip(IpAddr::V6(ip)),
            Some(url::Host::Domain(_)) => Ok(()),
            None => Err(format!("{url} has no host")),
        }
    }

    fn check_ip(&self, ip: IpAddr) -> Result<(), String> {
        if self.permits(ip) {
            Ok(())
        } else {
            Err(format!(
                "outbound connection to {ip} refused: internal address not in --allow-upstream"
            ))
        }
    }

    /// A client builder whose every connection obeys this policy: the guard
    /// sits in the resolver, redirects are not followed, and no proxy is used
    /// (a proxy would resolve names itself, past the guard).
    pub fn client_builder(&self) -> reqwest::ClientBuilder {
        self.tls
            .apply(reqwest::Client::builder())
            .dns_resolver(Arc::new(GuardedResolver {
                policy: self.clone(),
            }))
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
    }

    /// A guarded client with a total timeout per request.
    pub fn client(&self, timeout: std::time::Duration) -> reqwest::Client {
        self.client_builder()
            .timeout(timeout)
            .connect_timeout(timeout.min(LOOKUP_TIMEOUT))
            .build()
            .expect("HTTP client configuration is valid")
    }
}

/// Loopback, private, link-local, unspecified ("this network"), multicast,
/// CGNAT, the IETF, benchmarking and reserved IPv4 blocks, ULA, IPv6
/// site-local, and the cloud metadata addresses (169.254.169.254 is
/// link-local; Azure's platform address 168.63.129.16 is public). An IPv6
/// address that carries an IPv4 one (mapped, translated, compatible, 6to4, or
/// the NAT64 prefix `64:ff9b::/96`) is judged by that; the local-use NAT64
/// prefix `64:ff9b:1::/48`, whose IPv4 address may sit at several places, and
/// Teredo (`2001::/32`, whose client address is obfuscated and whose relay is
/// anyone's) are internal as a whole.
pub fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_multicast()
                || v4.is_broadcast()
                // 0.0.0.0/8: Linux takes 0.0.0.0 for this host.
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 192 && b == 0 && v4.octets()[2] == 0)
                || (a == 198 && (18..20).contains(&b))
                || a >= 240
                // Azure's wireserver and DNS, reachable from every Azure VM.
                || v4 == std::net::Ipv4Addr::new(168, 63, 129, 16)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_internal(IpAddr::V4(v4));
            }
            let segments = v6.segments();
            // The low 32 bits.
            let embedded = std::net::Ipv4Addr::from(u128::from(v6) as u32);
            // NAT64's well-known prefix reaches the IPv4 address it ends in;
            // the deprecated IPv4-compatible form (::a.b.c.d) too, but for
            // `::` and `::1`, judged as IPv6 below.
            let nat64 = segments[..6] == [0x64, 0xff9b, 0, 0, 0, 0];
            let compatible = segments[..6] == [0; 6] && u32::from(embedded) > 1;
            // SIIT's IPv4-translated form, ::ffff:0:a.b.c.d.
            let translated = segments[..6] == [0, 0, 0, 0, 0xffff, 0];
            if nat64 || compatible || translated {
                return is_internal(IpAddr::V4(embedded));
            }
            // 6to4 (2002:a.b.c.d::/48) reaches a.b.c.d's network.
            if segments[0] == 0x2002 {
                let [high, low] = [segments[1], segments[2]];
                let site = (u32::from(high) << 16) | u32::from(low);
                return is_internal(IpAddr::V4(site.into()));
            }
            let first = segments[0];
            segments[..3] == [0x64, 0xff9b, 1]
                || segments[..2] == [0x2001, 0]
                || v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
                // Site-local, deprecated but still routed by some networks.
                || (first & 0xffc0) == 0xfec0
        }
    }
}

/// Longest lookup for the reqwest clients, and their longest connect (which
/// covers the lookup too).
const LOOKUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

struct GuardedResolver {
    policy: OutboundPolicy,
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let policy = self.policy.clone();
        Box::pin(async move {
            let allowed = policy
                .resolve_allowed(name.as_str(), LOOKUP_TIMEOUT)
                .await?;
            Ok(Box::new(allowed.into_iter()) as Addrs)
        })
    }
}

impl OutboundPolicy {
    /// Resolves `host` within `timeout` and keeps the addresses this policy
    /// permits; none permitted is an error that names the reason.
    async fn resolve_allowed(
        &self,
        host: &str,
        timeout: std::time::Duration,
    ) -> std::io::Result<Vec<SocketAddr>> {
        let resolved = match tokio::time::timeout(timeout, tokio::net::lookup_host((host, 0))).await
        {
            Ok(resolved) => resolved?,
            Err(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("looking up {host} took longer than {timeout:?}"),
                ));
            }
        };
        let allowed: Vec<SocketAddr> = resolved.filter(|addr| self.permits(addr.ip())).collect();
        if allowed.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!("{host} resolves only to internal addresses not in --allow-upstream"),
            ));
        }
        Ok(allowed)
    }
}

/// The guard as a resolver for hyper's connector, which the agent client
/// uses directly (see `upstream::transport`).
#[derive(Clone, Debug)]
pub struct GuardedNames {
    policy: OutboundPolicy,
    /// Longest lookup: hyper's connect timeout covers the TCP connect only.
    timeout: std::time::Duration,
}

impl GuardedNames {
    /// A resolver obeying `policy`, giving up on a lookup after `timeout`.
    pub fn new(policy: &OutboundPolicy, timeout: std::time::Duration) -> Self {
        Self {
            policy: policy.clone(),
            timeout,
        }
    }
}

impl tower_service::Service<hyper_util::client::legacy::connect::dns::Name> for GuardedNames {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = std::io::Result<Self::Response>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: hyper_util::client::legacy::connect::dns::Name) -> Self::Future {
        let (policy, timeout) = (self.policy.clone(), self.timeout);
        Box::pin(async move {
            let allowed = policy.resolve_allowed(name.as_str(), timeout).await?;
            Ok(allowed.into_iter())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_addresses_need_an_allowance() {
        let policy = OutboundPolicy::default();
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "192.168.0.1",
            "169.254.169.254",
            "0.1.2.3",
            "192.0.0.8",
            "198.18.0.1",
            "198.19.255.254",
            "240.0.0.1",
            "::1",
            "fec0::1",
            "::",
            "fd00::1",
            // IPv4 inside IPv6: NAT64, compatible, mapped.
            "64:ff9b::a9fe:a9fe",
            "64:ff9b::10.0.0.1",
            "::10.0.0.1",
            "::ffff:127.0.0.1",
            // SIIT-translated, 6to4, local-use NAT64.
            "::ffff:0:127.0.0.1",
            "2002:a9fe:a9fe::1",
            "2002:c0a8:1::1",
            "64:ff9b:1::a9fe:a9fe",
            "64:ff9b:1:a9fe:a9:fe00::",
            // Azure's platform address; Teredo, whose client is obfuscated.
            "168.63.129.16",
            "::ffff:168.63.129.16",
            "2001:0:4136:e378:8000:63bf:3fff:fdd2",
        ] {
            assert!(!policy.permits(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "93.184.216.34",
            "198.20.0.1",
            "192.0.2.1",
            "64:ff9b::808:808",
            "::8.8.8.8",
            "::ffff:0:8.8.8.8",
            "2002:808:808::1",
            "2001:db8::1",
            "2606:4700:4700::1111",
            "168.63.129.17",
        ] {
            assert!(policy.permits(ip.parse().unwrap()), "{ip}");
        }
        let loopback = OutboundPolicy {
            allow: vec!["127.0.0.0/8".parse().unwrap()],
            ..OutboundPolicy::default()
        };
        assert!(loopback.permits("127.0.0.1".parse().unwrap()));
        assert!(!loopback.permits("10.0.0.1".parse().unwrap()));
    }
}
