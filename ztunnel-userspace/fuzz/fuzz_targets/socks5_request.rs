//! The SOCKS5 listener's parsers: the greeting, then the request, on the
//! bytes a client sends (in one go, as a pipelining client would).
//!
//! Asserts: no panic; `Incomplete(n)` always asks for more than it was given
//! (the listener would otherwise spin); feeding the parser exactly the bytes
//! it asks for, as the listener does, decides the same as handing it all
//! the bytes at once; a parsed request re-encodes to the bytes it was
//! parsed from (bar the reserved byte) and decodes back to the same target.

#![no_main]

use std::net::SocketAddr;

use libfuzzer_sys::fuzz_target;
use ztunnel::proxy::socks5::{Parsed, SocksError, Target, parse_greeting, parse_request};

type Parser<T> = fn(&[u8]) -> Result<Parsed<T>, SocksError>;

/// What the listener's read loop decides on a stream holding `data` and
/// then ending: `None` when the stream ends first.
fn drive<T: std::fmt::Debug>(parse: Parser<T>, data: &[u8]) -> Option<Result<Parsed<T>, String>> {
    let mut have = 0;
    loop {
        match parse(&data[..have]) {
            Ok(Parsed::Incomplete(needed)) => {
                assert!(needed > have, "Incomplete({needed}) after {have} bytes");
                if needed > data.len() {
                    return None;
                }
                have = needed;
            }
            Ok(done) => return Some(Ok(done)),
            Err(e) => return Some(Err(e.to_string())),
        }
    }
}

/// Parses `data` both ways, checks they agree, and returns the value and
/// the bytes it used.
fn parse_both<T: std::fmt::Debug + PartialEq>(parse: Parser<T>, data: &[u8]) -> Option<(T, usize)> {
    let whole = parse(data);
    if let Ok(Parsed::Incomplete(needed)) = &whole {
        assert!(
            *needed > data.len(),
            "Incomplete({needed}) with {} bytes",
            data.len()
        );
    }
    let stepwise = drive(parse, data);
    match (whole, stepwise) {
        (Ok(Parsed::Incomplete(_)), None) => None,
        (Ok(Parsed::Done(value, used)), Some(Ok(Parsed::Done(stepped, stepped_used)))) => {
            assert!(used <= data.len());
            assert_eq!((&value, used), (&stepped, stepped_used));
            Some((value, used))
        }
        (Err(e), Some(Err(stepped))) => {
            assert_eq!(e.to_string(), stepped);
            None
        }
        (whole, stepwise) => panic!("one-shot {whole:?} but read loop {stepwise:?}"),
    }
}

fn encode(target: &Target) -> Vec<u8> {
    let mut out = vec![5, 1, 0];
    let port = match target {
        Target::Addr(SocketAddr::V4(a)) => {
            out.push(1);
            out.extend_from_slice(&a.ip().octets());
            a.port()
        }
        Target::Addr(SocketAddr::V6(a)) => {
            out.push(4);
            out.extend_from_slice(&a.ip().octets());
            a.port()
        }
        Target::Name(name, port) => {
            out.push(3);
            out.push(u8::try_from(name.len()).expect("a parsed name fits in a length byte"));
            out.extend_from_slice(name.as_bytes());
            *port
        }
    };
    out.extend_from_slice(&port.to_be_bytes());
    out
}

fuzz_target!(|data: &[u8]| {
    // The request alone too, so that mutations reach it without first
    // having to form a greeting.
    let _ = parse_both(parse_request, data);
    let Some(((), greeting)) = parse_both(parse_greeting, data) else {
        return;
    };
    let rest = &data[greeting..];
    let Some((target, used)) = parse_both(parse_request, rest) else {
        return;
    };
    let mut encoded = encode(&target);
    assert_eq!(encoded.len(), used);
    // RSV is ignored by the parser.
    encoded[2] = rest[2];
    assert_eq!(&encoded[..], &rest[..used]);
    assert_eq!(
        parse_request(&encoded).expect("re-encoded request parses"),
        Parsed::Done(target, used)
    );
});
