def main():
    print("hello from zipapp")
