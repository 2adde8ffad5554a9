//! Signature checks and signing for RMB identities (spec/rmb.md §1.3) and SBD `ares`.
//!
//! RMB signatures are 65 bytes: a type prefix (`e` = ed25519, `s` = sr25519) and 64 signature
//! bytes. sr25519 is schnorrkel with substrate's signing context `b"substrate"`; keys come from
//! a 32-byte mini secret expanded the substrate way (`ExpansionMode::Ed25519`). A signature
//! that does not verify is `false`; only a key or signature of the wrong *shape* is an error.

use crate::error::{Error, Result};
use ed25519_dalek::{Signer as _, Verifier as _};
use schnorrkel::{ExpansionMode, MiniSecretKey};

/// defined by substrate (`sp_core::sr25519`): every sr25519 signature is made in this context
pub const SUBSTRATE_CONTEXT: &[u8] = b"substrate";
/// defined by rmb-rs: the first byte of a 65-byte signature names its scheme
pub const PREFIX_ED25519: u8 = b'e';
pub const PREFIX_SR25519: u8 = b's';
pub const PUBLIC_KEY_LEN: usize = 32;
pub const SIGNATURE_LEN: usize = 64;
pub const PREFIXED_SIGNATURE_LEN: usize = 65;
pub const SEED_LEN: usize = 32;

fn fixed<const N: usize>(bytes: &[u8], what: &str) -> Result<[u8; N]> {
    bytes
        .try_into()
        .map_err(|_| Error::Signature(format!("{what} must be {N} bytes, got {}", bytes.len())))
}

/// RFC 8032 ed25519, non-strict as ed25519-dalek's `verify` (what the SBD and RMB servers use).
pub fn verify_ed25519(public_key: &[u8], message: &[u8], signature: &[u8]) -> Result<bool> {
    let pk: [u8; PUBLIC_KEY_LEN] = fixed(public_key, "public key")?;
    let sig: [u8; SIGNATURE_LEN] = fixed(signature, "signature")?;
    let Ok(key) = ed25519_dalek::VerifyingKey::from_bytes(&pk) else {
        return Ok(false); // not a curve point: no signature can match it
    };
    let sig = ed25519_dalek::Signature::from_bytes(&sig);
    Ok(key.verify(message, &sig).is_ok())
}

/// schnorrkel sr25519 in the substrate context.
pub fn verify_sr25519(public_key: &[u8], message: &[u8], signature: &[u8]) -> Result<bool> {
    let pk: [u8; PUBLIC_KEY_LEN] = fixed(public_key, "public key")?;
    let sig: [u8; SIGNATURE_LEN] = fixed(signature, "signature")?;
    let Ok(key) = schnorrkel::PublicKey::from_bytes(&pk) else {
        return Ok(false);
    };
    let Ok(sig) = schnorrkel::Signature::from_bytes(&sig) else {
        return Ok(false); // e.g. missing the schnorrkel marker bit: not an sr25519 signature
    };
    Ok(key.verify_simple(SUBSTRATE_CONTEXT, message, &sig).is_ok())
}

/// The 65-byte RMB form: dispatch on the prefix byte.
pub fn verify_prefixed(public_key: &[u8], message: &[u8], signature: &[u8]) -> Result<bool> {
    if signature.len() != PREFIXED_SIGNATURE_LEN {
        return Err(Error::Signature(format!(
            "signature must be {PREFIXED_SIGNATURE_LEN} bytes, got {}",
            signature.len()
        )));
    }
    match signature[0] {
        PREFIX_ED25519 => verify_ed25519(public_key, message, &signature[1..]),
        PREFIX_SR25519 => verify_sr25519(public_key, message, &signature[1..]),
        other => Err(Error::Signature(format!(
            "unknown signature type {other:#04x} (expected 'e' or 's')"
        ))),
    }
}

/// A private key of either scheme.
#[derive(Clone)]
pub enum SigningKey {
    Ed25519(Box<ed25519_dalek::SigningKey>),
    Sr25519(Box<schnorrkel::Keypair>),
}

impl SigningKey {
    pub fn ed25519(seed: &[u8]) -> Result<Self> {
        let seed: [u8; SEED_LEN] = fixed(seed, "ed25519 seed")?;
        Ok(Self::Ed25519(Box::new(
            ed25519_dalek::SigningKey::from_bytes(&seed),
        )))
    }

    pub fn sr25519(mini_secret: &[u8]) -> Result<Self> {
        let mini = MiniSecretKey::from_bytes(mini_secret).map_err(|_| {
            Error::Signature(format!(
                "sr25519 mini secret must be {SEED_LEN} bytes, got {}",
                mini_secret.len()
            ))
        })?;
        Ok(Self::Sr25519(Box::new(
            mini.expand_to_keypair(ExpansionMode::Ed25519),
        )))
    }

    pub fn key_type(&self) -> &'static str {
        match self {
            Self::Ed25519(_) => "ed25519",
            Self::Sr25519(_) => "sr25519",
        }
    }

    pub fn prefix(&self) -> u8 {
        match self {
            Self::Ed25519(_) => PREFIX_ED25519,
            Self::Sr25519(_) => PREFIX_SR25519,
        }
    }

    pub fn public_key(&self) -> [u8; PUBLIC_KEY_LEN] {
        match self {
            Self::Ed25519(key) => key.verifying_key().to_bytes(),
            Self::Sr25519(pair) => pair.public.to_bytes(),
        }
    }

    /// 64 signature bytes (sr25519 signatures are randomised, as in substrate).
    pub fn sign(&self, message: &[u8]) -> [u8; SIGNATURE_LEN] {
        match self {
            Self::Ed25519(key) => key.sign(message).to_bytes(),
            Self::Sr25519(pair) => pair.sign_simple(SUBSTRATE_CONTEXT, message).to_bytes(),
        }
    }

    pub fn sign_prefixed(&self, message: &[u8]) -> [u8; PREFIXED_SIGNATURE_LEN] {
        let mut out = [0u8; PREFIXED_SIGNATURE_LEN];
        out[0] = self.prefix();
        out[1..].copy_from_slice(&self.sign(message));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEED: [u8; 32] = [7u8; 32];

    #[test]
    fn ed25519_round_trip_and_tamper() {
        let key = SigningKey::ed25519(&SEED).unwrap();
        let sig = key.sign(b"hello");
        assert!(verify_ed25519(&key.public_key(), b"hello", &sig).unwrap());
        assert!(!verify_ed25519(&key.public_key(), b"hellO", &sig).unwrap());
    }

    #[test]
    fn ed25519_rfc8032_test_vector_1() {
        // RFC 8032 §7.1 TEST 1: empty message
        let seed = hex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60");
        let key = SigningKey::ed25519(&seed).unwrap();
        assert_eq!(
            key.public_key().to_vec(),
            hex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
        );
        let expected = hex(concat!(
            "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e06522490155",
            "5fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"
        ));
        assert_eq!(key.sign(b"").to_vec(), expected);
    }

    #[test]
    fn sr25519_round_trip_and_tamper() {
        let key = SigningKey::sr25519(&SEED).unwrap();
        let sig = key.sign(b"hello");
        assert!(verify_sr25519(&key.public_key(), b"hello", &sig).unwrap());
        assert!(!verify_sr25519(&key.public_key(), b"other", &sig).unwrap());
    }

    #[test]
    fn sr25519_signature_without_marker_is_false_not_error() {
        let key = SigningKey::sr25519(&SEED).unwrap();
        let mut sig = key.sign(b"m");
        sig[63] &= 0x7f;
        assert!(!verify_sr25519(&key.public_key(), b"m", &sig).unwrap());
    }

    #[test]
    fn prefixed_dispatches_on_first_byte() {
        for key in [
            SigningKey::ed25519(&SEED).unwrap(),
            SigningKey::sr25519(&SEED).unwrap(),
        ] {
            let sig = key.sign_prefixed(b"jwt");
            assert_eq!(sig[0], key.prefix());
            assert!(verify_prefixed(&key.public_key(), b"jwt", &sig).unwrap());
            assert!(!verify_prefixed(&key.public_key(), b"jw", &sig).unwrap());
        }
    }

    #[test]
    fn wrong_prefix_or_shape_is_an_error() {
        let key = SigningKey::ed25519(&SEED).unwrap();
        let mut sig = key.sign_prefixed(b"x");
        sig[0] = b'x';
        assert!(verify_prefixed(&key.public_key(), b"x", &sig).is_err());
        assert!(verify_prefixed(&key.public_key(), b"x", &sig[..64]).is_err());
        assert!(verify_ed25519(&[0u8; 31], b"x", &[0u8; 64]).is_err());
        assert!(verify_sr25519(&[0u8; 32], b"x", &[0u8; 63]).is_err());
        assert!(SigningKey::sr25519(&[0u8; 31]).is_err());
        assert!(SigningKey::ed25519(&[0u8; 33]).is_err());
    }

    #[test]
    fn ed25519_signature_does_not_pass_as_sr25519() {
        let ed = SigningKey::ed25519(&SEED).unwrap();
        let mut sig = ed.sign_prefixed(b"x");
        sig[0] = PREFIX_SR25519;
        assert!(!verify_prefixed(&ed.public_key(), b"x", &sig).unwrap());
    }

    fn hex(text: &str) -> Vec<u8> {
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
            .collect()
    }
}

pub mod py {
    use pyo3::prelude::*;
    use pyo3::types::PyBytes;

    #[pyfunction]
    fn verify_ed25519(public_key: &[u8], message: &[u8], signature: &[u8]) -> PyResult<bool> {
        Ok(super::verify_ed25519(public_key, message, signature)?)
    }

    #[pyfunction]
    fn verify_sr25519(public_key: &[u8], message: &[u8], signature: &[u8]) -> PyResult<bool> {
        Ok(super::verify_sr25519(public_key, message, signature)?)
    }

    #[pyfunction]
    fn verify_prefixed(public_key: &[u8], message: &[u8], signature: &[u8]) -> PyResult<bool> {
        Ok(super::verify_prefixed(public_key, message, signature)?)
    }

    /// A private key for signing JWTs and envelopes.
    #[pyclass(frozen, module = "rmb_relay._core")]
    pub struct SigningKey {
        inner: super::SigningKey,
    }

    impl SigningKey {
        /// The key itself, for Rust code that signs (load.rs).
        pub(crate) fn key(&self) -> &super::SigningKey {
            &self.inner
        }
    }

    #[pymethods]
    impl SigningKey {
        #[staticmethod]
        fn ed25519(seed: &[u8]) -> PyResult<Self> {
            Ok(Self {
                inner: super::SigningKey::ed25519(seed)?,
            })
        }

        #[staticmethod]
        fn sr25519(mini_secret: &[u8]) -> PyResult<Self> {
            Ok(Self {
                inner: super::SigningKey::sr25519(mini_secret)?,
            })
        }

        #[getter]
        fn key_type(&self) -> &'static str {
            self.inner.key_type()
        }

        #[getter]
        fn public_key<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
            PyBytes::new(py, &self.inner.public_key())
        }

        fn sign<'py>(&self, py: Python<'py>, message: &[u8]) -> Bound<'py, PyBytes> {
            PyBytes::new(py, &self.inner.sign(message))
        }

        fn sign_prefixed<'py>(&self, py: Python<'py>, message: &[u8]) -> Bound<'py, PyBytes> {
            PyBytes::new(py, &self.inner.sign_prefixed(message))
        }

        fn __repr__(&self) -> String {
            let pk: String = self
                .inner
                .public_key()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            format!("<SigningKey {} {}>", self.inner.key_type(), pk)
        }
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_function(wrap_pyfunction!(verify_ed25519, m)?)?;
        m.add_function(wrap_pyfunction!(verify_sr25519, m)?)?;
        m.add_function(wrap_pyfunction!(verify_prefixed, m)?)?;
        m.add_class::<SigningKey>()?;
        Ok(())
    }
}
